"""Executing plait programs against a backend: states, forks, streaming, run / run_batch."""

from __future__ import annotations

from typing import Any

from plait.interpreter.backends import FEATURES, Backend, MockBackend, MockCall, create_backend
from plait.interpreter.chat_template import (
    CHATML,
    ChatMLTemplate,
    ChatTemplate,
    RenderedChatTemplate,
    RoleMarkers,
    jinja_chat_template,
)
from plait.interpreter.errors import (
    BackendError,
    GenerationError,
    OutputParseError,
    ProgramCancelled,
    UnsupportedFeatureError,
)
from plait.interpreter.run import precache, render_prefix, run_program, run_program_batch
from plait.interpreter.state import ForkGroup, ProgramState
from plait.interpreter.state_data import ToolCall
from plait.lang.context import get_default_backend, set_default_backend

__all__ = [
    "CHATML",
    "FEATURES",
    "Backend",
    "BackendError",
    "ChatMLTemplate",
    "ChatTemplate",
    "Endpoint",
    "ForkGroup",
    "GenerationError",
    "MockBackend",
    "MockCall",
    "OutputParseError",
    "ProgramCancelled",
    "ProgramState",
    "RenderedChatTemplate",
    "RoleMarkers",
    "Runtime",
    "ToolCall",
    "UnsupportedFeatureError",
    "create_backend",
    "get_default_backend",
    "jinja_chat_template",
    "precache",
    "render_prefix",
    "run_program",
    "run_program_batch",
    "set_default_backend",
]


def __getattr__(name: str) -> Any:
    if name in ("Runtime", "Endpoint"):
        from plait.interpreter import backends

        return getattr(backends, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
