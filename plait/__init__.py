"""plait: a structured-generation programming runtime for language models.

from plait import Engine
engine = Engine()                      # the embedded SmolLM2-135M-Instruct
engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from plait.runtime.engine import Engine  # noqa: F401
    from plait.runtime.protocol import SamplingParams  # noqa: F401

_LAZY = {
    **{
        name: "plait.lang"
        for name in (
            "program",
            "gen",
            "gen_int",
            "gen_string",
            "select",
            "system",
            "user",
            "assistant",
            "role",
            "fork",
            "join",
            "describe_tools",
            "set_default_backend",
            "get_default_backend",
        )
    },
    "Runtime": "plait.interpreter.backends.local",
    "Endpoint": "plait.interpreter.backends.http",
    "MockBackend": "plait.interpreter.backends.mock",
    "Backend": "plait.interpreter.backends.base",
    "ProgramState": "plait.interpreter.state",
    "Engine": "plait.runtime.engine",
    "SamplingParams": "plait.runtime.protocol",
    "default_model_path": "plait.runtime.model_loader.locate",
}

__all__ = sorted([*_LAZY, "__version__"])


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so `import plait` (and the CLI's --help) does not pay for importing torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'plait' has no attribute {name!r}")
