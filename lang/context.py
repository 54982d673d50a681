"""The process-wide default backend, used by `run` / `run_batch` when none is passed."""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_default_backend: Any = None


def set_default_backend(backend: Any) -> None:
    """Make `backend` (a `Runtime`, `Endpoint`, `MockBackend`, ...) the default; None clears it."""
    global _default_backend
    if backend is not None and not hasattr(backend, "run_program"):
        raise TypeError(f"set_default_backend: {type(backend).__name__} is not a plait backend")
    with _lock:
        _default_backend = backend


def get_default_backend() -> Any:
    with _lock:
        backend = _default_backend
    if backend is None:
        raise RuntimeError(
            "no backend: pass backend=... to run / run_batch, or call "
            "plait.set_default_backend(plait.Runtime()) first"
        )
    return backend
