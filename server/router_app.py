"""`create_router_app(urls)`: the data-parallel front. The same native, OpenAI and program
routes as one server, each request forwarded to the replica the `Router` chooses.

    GET /health        200 while a replica is healthy (503 when none is), with every replica
    GET /get_server_info   the first healthy replica's answer plus `router`: config and replicas
    POST /flush_cache, /abort_request   sent to every replica
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from plait.server import route_keys
from plait.server.auth import APIKeyMiddleware
from plait.server.dashboard_router import install_router_dashboard
from plait.server.errors import install_error_handlers, read_object
from plait.server.metrics import CONTENT_TYPE
from plait.server.proxy import Proxy
from plait.server.replica_health import HealthMonitor
from plait.server.router_metrics import RouterMetrics
from plait.server.routing import Router, RouterConfig

_PASS_GET = (
    "/get_model_info",
    "/v1/models",
    "/v1/models/{model_id:path}",
    "/programs",
    "/health_generate",
)


class RouterState:
    def __init__(self, router: Router, api_key: str | None) -> None:
        self.router = router
        self.metrics = RouterMetrics(router)
        self.proxy = Proxy(router, self.metrics)
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.monitor = HealthMonitor(router, auth).start()

    def replicas(self) -> list[dict[str, Any]]:
        return [r.describe() for r in self.router.replicas]

    def close(self) -> None:
        self.monitor.stop()


def create_router_app(
    replicas: list[str] | Router, config: RouterConfig | None = None, api_key: str | None = None
) -> FastAPI:
    """The router in front of `replicas` (URLs, or a `Router` whose replicas the caller made).
    Call `app.state.router.close()` to stop its health checks."""
    router = replicas if isinstance(replicas, Router) else Router.for_urls(replicas, config)
    app = FastAPI(title="plait router", docs_url=None, redoc_url=None)
    state = RouterState(router, api_key)
    app.state.router = state
    install_error_handlers(app)

    async def forward(request: Request, path: str, key_of: Any) -> Response:
        raw = await request.body()
        body = await read_object(request)
        stream = body.get("stream") is True
        return await state.proxy.forward(request, path, raw, key_of(body), stream, body)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await forward(request, "/generate", route_keys.generate_key)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions", route_keys.completion_key)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions", route_keys.chat_key)

    @app.post("/programs/{name}")
    async def run_program(name: str, request: Request) -> Response:
        return await forward(
            request, f"/programs/{name}", lambda body: route_keys.program_key(name, body)
        )

    async def pass_through(request: Request) -> Response:
        return await state.proxy.any_replica(request, request.url.path)

    for path in _PASS_GET:
        app.add_api_route(path, pass_through, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        replicas = state.replicas()
        ok = any(r["healthy"] for r in replicas)
        body = {"status": "ok" if ok else "no healthy replica", "replicas": replicas}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> Response:
        info: dict[str, Any] = {}
        upstream = await state.proxy.any_replica(request, "/get_server_info")
        if upstream.status_code == 200:
            import json

            info = json.loads(upstream.body)
        info["router"] = {"config": dataclasses.asdict(router.config), "replicas": state.replicas()}
        return JSONResponse(info)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        answers = await state.proxy.broadcast(request, "/flush_cache")
        failed = [
            f"{url}: {body.decode(errors='replace')}" for url, code, body in answers if code != 200
        ]
        if failed:
            return PlainTextResponse(
                "Cache not flushed on every replica.\n" + "\n".join(failed), status_code=400
            )
        for replica in router.replicas:
            replica.tree.clear()
        return PlainTextResponse(f"Cache flushed on {len(answers)} replica(s).")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        answers = await state.proxy.broadcast(request, "/abort_request")
        bad = next(((code, body) for _, code, body in answers if code == 400), None)
        if bad is not None:  # the body was invalid: every replica says so alike
            return Response(bad[1], status_code=400, media_type="application/json")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    install_router_dashboard(app, state)
    return app
