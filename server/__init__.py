"""The plait HTTP server: SGLang-native and OpenAI-compatible APIs, programs, metrics.

    from plait.server import create_app, serve_in_thread
    server = serve_in_thread(engine)          # uvicorn on a free loopback port; server.url

See docs/server.md.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "create_app": "plait.server.app",
    "ServerConfig": "plait.server.state",
    "ServerThread": "plait.server.launch",
    "ServerProcess": "plait.server.launch",
    "serve_in_thread": "plait.server.launch",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so `plait serve --help` does not import FastAPI and torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'plait.server' has no attribute {name!r}")
