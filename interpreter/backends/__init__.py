"""Backends: where a program's model calls go. `Runtime` and `Endpoint` load lazily."""

from __future__ import annotations

from typing import Any

from plait.interpreter.backends.base import FEATURES, Backend
from plait.interpreter.backends.mock import MockBackend, MockCall

__all__ = [
    "FEATURES",
    "Backend",
    "Endpoint",
    "MockBackend",
    "MockCall",
    "Runtime",
    "create_backend",
]


def __getattr__(name: str) -> Any:
    if name == "Runtime":
        from plait.interpreter.backends.local import Runtime

        return Runtime
    if name == "Endpoint":
        from plait.interpreter.backends.http import Endpoint

        return Endpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def create_backend(kind: str = "auto", **kwargs: Any) -> Backend:
    """ "runtime" (in-process engine), "endpoint" (needs url=), "mock"; "auto": endpoint when a
    url is given, else runtime."""
    if kind == "auto":
        kind = "endpoint" if "url" in kwargs else "runtime"
    if kind == "runtime":
        from plait.interpreter.backends.local import Runtime

        return Runtime(**kwargs)
    if kind == "endpoint":
        from plait.interpreter.backends.http import Endpoint

        return Endpoint(**kwargs)
    if kind == "mock":
        return MockBackend(**kwargs)
    raise ValueError(f"backend: expected 'auto', 'runtime', 'endpoint' or 'mock', got {kind!r}")
