"""The server's configuration and the state its routes share."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from plait.runtime.protocol import CLOSED_FINISH_REASONS
from plait.server.calls import Admission
from plait.server.kv_handoff import ROLES
from plait.server.metrics import ServerMetrics

try:  # the installed distribution's version (the package's own `plait.__version__`)
    PLAIT_VERSION = version("plait")
except PackageNotFoundError:  # run from a source tree that was never installed
    PLAIT_VERSION = "unknown"

if TYPE_CHECKING:
    from plait.lang.program import Program


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    programs: tuple[str, ...] = ()  # files or modules whose @program functions are served
    served_model_name: str | None = None  # the model id in /v1/models (else `default_model_name`)
    closed_finish_reason: str = "length"  # a request's default (`stop`: parse-friendly)
    accept_any_model: bool = False  # OpenAI routes: any `model` is served (else 404 but this one)
    max_queue: int | None = None  # requests allowed to wait beyond the running batch
    retry_after: int = 1  # seconds, in the Retry-After header of a 503
    request_timeout: float | None = None  # seconds; a request's default `timeout` (504 past it)
    max_body_bytes: int = 16 << 20  # larger request bodies get a 413
    log_level: str = "info"
    role: str = "both"  # prefill | decode: one half of disaggregated serving (kv_handoff.py)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: must not be empty (leave it unset for no key)")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue: must be non-negative, got {self.max_queue}")
        if self.request_timeout is not None and not 0 < self.request_timeout <= 7 * 24 * 3600:
            raise ValueError(
                f"request_timeout: must be in (0, 604800] seconds, got {self.request_timeout}"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be at least 1024, got {self.max_body_bytes}")
        if self.closed_finish_reason not in CLOSED_FINISH_REASONS:
            raise ValueError(
                f"closed_finish_reason: expected one of {', '.join(CLOSED_FINISH_REASONS)}, "
                f"got {self.closed_finish_reason!r}"
            )
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {self.role!r}")
        if self.retry_after < 1:
            raise ValueError(f"retry_after: must be at least 1 second, got {self.retry_after}")
        if isinstance(self.programs, str):
            object.__setattr__(self, "programs", (self.programs,))


def default_model_name(model_path: str) -> str:
    """The id a model is served under unless named: its GGUF file's stem, or its folder's name
    (`.../SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct.Q4_1`)."""
    name = os.path.basename(model_path.rstrip("/" + os.sep)).removesuffix(".gguf")
    return name or model_path


@dataclass
class ServerState:
    engine: Any
    config: ServerConfig
    programs: dict[str, Program] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        sched = self.engine.config.scheduler
        queue = self.config.max_queue
        if queue is None:
            queue = sched.max_queued_requests
        limit = None if queue is None else sched.max_running_requests + queue
        self.admission = Admission(limit, self.config.retry_after)
        self.metrics = ServerMetrics(self.engine, self.admission)
        stats = self.engine.stats()
        self.pool_tokens: int = stats["kv_pages_total"] * stats["page_size"]
        # the interpreter backend programs run on: this server's engine, in process (None: no
        # programs are served)
        self.backend: Any = None
        if self.programs:
            from plait.interpreter.backends.local import Runtime

            self.backend = Runtime(engine=self.engine)
        self.push_client: Any = None  # httpx.AsyncClient of a prefill server's KV pushes

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or default_model_name(str(self.engine.model_path))
