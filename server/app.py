"""`create_app(engine)`: the FastAPI application around one `Engine`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from plait.server import native, openai_api, programs
from plait.server.auth import APIKeyMiddleware
from plait.server.dashboard import DashboardConfig, install_dashboard
from plait.server.errors import install_error_handlers
from plait.server.kv_handoff import IMPORT_PATH, install_kv_handoff
from plait.server.limits import LimitsMiddleware
from plait.server.metrics import CONTENT_TYPE
from plait.server.openapi import install_openapi
from plait.server.state import PLAIT_VERSION, ServerConfig, ServerState

if TYPE_CHECKING:
    from plait.lang.program import Program


def create_app(
    engine: Any,
    config: ServerConfig | None = None,
    program_registry: dict[str, Program] | None = None,
    dashboard: DashboardConfig | None = None,
) -> FastAPI:
    """The server for `engine` (which the caller owns and shuts down). Programs come from
    `config.programs` (files or modules) unless `program_registry` is given; `dashboard` sets
    up `/dashboard` (see `server/dashboard.py`)."""
    config = config or ServerConfig()
    if program_registry is None:
        program_registry = programs.load_programs(config.programs) if config.programs else {}
    app = FastAPI(title="plait", version=PLAIT_VERSION, docs_url=None, redoc_url=None)
    app.state.plait = ServerState(engine, config, dict(program_registry))
    install_error_handlers(app)
    install_openapi(app)
    app.include_router(native.router)
    app.include_router(openai_api.router)
    app.include_router(programs.router)
    install_kv_handoff(app)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.plait.metrics.render(), media_type=CONTENT_TYPE)

    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    install_dashboard(app, dashboard)  # its static page is served before the key check
    # runs first; pushed KV may exceed the body limit (its route has its own: the pool's size)
    app.add_middleware(
        LimitsMiddleware, max_body_bytes=config.max_body_bytes, exempt=(IMPORT_PATH,)
    )
    return app
