"""The server the runs drive: a real uvicorn on loopback around an engine in this process (so
faults can be injected into the engine's own objects), on a tiny random-weight model by default."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def tiny_model_dir() -> Path:
    """A random-weight Llama with the SmolLM2 tokenizer, as the tests use (written once per run)."""
    from plait.runtime.model_loader.gguf_file import read_gguf_metadata
    from plait.runtime.model_loader.locate import default_model_path
    from plait.runtime.tokenizer import Tokenizer
    from tests.conftest import write_tiny_checkpoint

    tokenizer = Tokenizer.from_gguf_metadata(read_gguf_metadata(default_model_path()))
    path = Path(tempfile.mkdtemp(prefix="plait-reliability-")) / "tiny-llama"
    return write_tiny_checkpoint(path, "llama", tokenizer)


@contextmanager
def running_server(
    model: str | Path, engine_args: dict | None = None, **config: Any
) -> Iterator[Any]:
    """Yields the `ServerThread` with `.engine` and `.app_state` (the routes' `ServerState`)."""
    from plait import Engine
    from plait.server.app import create_app
    from plait.server.launch import ServerThread
    from plait.server.state import ServerConfig

    args = {"max_total_tokens": 8192, "page_size": 4, **(engine_args or {})}
    engine = Engine(model_path=str(model), **args)
    app = create_app(engine, ServerConfig(**config))
    server = ServerThread(app, log_level="critical").start()
    server.engine = engine
    server.app_state = app.state.plait
    try:
        yield server
    finally:
        server.stop()
        engine.shutdown()
