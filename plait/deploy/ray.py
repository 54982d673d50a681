"""plait on Ray Serve (`pip install 'plait[ray]'`): engine replicas and an ingress as Serve
deployments, with plait's cache-aware routing inside Serve's handles and autoscaling on queue
length.

- `PlaitReplica`: one `Engine` and its plait server on a loopback port inside the replica actor;
  `call` / `stream` forward one HTTP request to it, so every route behaves exactly as on
  `plait serve`.
- `PlaitIngress`: the HTTP front (native `/generate`, OpenAI routes, programs). It computes each
  request's route key and calls the replicas through a handle whose request router is
  `PlaitRequestRouter`. A replica that dies before anything was streamed is retried on another.
- `build_app(args)`: the application, for `serve.run(build_app({...}))` or a `serve run` config
  (`import_path: plait.deploy.ray:build_app`, see docs/scaling.md).
"""

# NOTE: no `from __future__ import annotations`: Serve rebuilds the routes' signatures from
# the class, and FastAPI must see `Request` as a class there, not as a string.
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig

from plait.server import route_keys
from plait.server.errors import APIError, install_error_handlers, read_object
from plait.server.proxy import forward_headers, stream_error

_REPLICA_DIED = (RayActorError, ActorUnavailableError)
_ROUTER_KEYS = (
    "cache_threshold",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "max_tree_chars",
    "max_sessions",
)
_PASS_GET = ("/get_model_info", "/v1/models", "/programs", "/get_server_info", "/health_generate")


class PlaitReplica:
    def __init__(self, engine_kwargs: dict[str, Any], programs: tuple[str, ...] = ()) -> None:
        from plait.runtime.engine import Engine
        from plait.server.launch import serve_in_thread

        self.engine = Engine(**engine_kwargs)
        self.server = serve_in_thread(self.engine, programs=tuple(programs))
        self.client = httpx.AsyncClient(base_url=self.server.url, timeout=httpx.Timeout(None))

    async def call(
        self, method: str, path: str, key: str, body: bytes, headers: dict[str, str]
    ) -> dict[str, Any]:
        r = await self.client.request(method, path, content=body, headers=headers)
        return {
            "status": r.status_code,
            "content_type": r.headers.get("content-type"),
            "body": r.content,
        }

    async def stream(
        self, method: str, path: str, key: str, body: bytes, headers: dict[str, str]
    ) -> AsyncIterator[Any]:
        """Yields the status first, then the body's chunks."""
        async with self.client.stream(method, path, content=body, headers=headers) as r:
            yield {"status": r.status_code, "content_type": r.headers.get("content-type")}
            async for chunk in r.aiter_bytes():
                yield chunk

    def check_health(self) -> None:
        if not self.server.thread.is_alive():
            raise RuntimeError("plait replica: its HTTP server stopped")

    def __del__(self) -> None:
        self.server.stop()
        self.engine.shutdown()


async def _relay(first: bytes, chunks: Any, path: str) -> AsyncIterator[bytes]:
    yield first
    try:
        async for chunk in chunks:
            yield chunk
    except _REPLICA_DIED as e:
        yield stream_error("(a Ray Serve replica)", e, path)


def _unavailable(errors: list[str]) -> APIError:
    return APIError(
        503,
        "ray: no replica could serve the request: " + "; ".join(errors),
        type="replica_error",
        headers={"Retry-After": "1"},
    )


app = FastAPI(title="plait on Ray Serve", docs_url=None, redoc_url=None)
install_error_handlers(app)


@serve.ingress(app)
class PlaitIngress:
    def __init__(self, replica: Any, max_attempts: int = 3) -> None:
        self.replica = replica
        self.max_attempts = max_attempts

    @app.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(self, request: Request) -> Response:
        return await self._forward(request, route_keys.generate_key)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward(request, route_keys.completion_key)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward(request, route_keys.chat_key)

    @app.post("/programs/{name}")
    async def run_program(self, name: str, request: Request) -> Response:
        return await self._forward(request, lambda body: route_keys.program_key(name, body))

    @app.get("/{path:path}")
    async def get(self, path: str, request: Request) -> Response:
        """The read-only routes every replica answers alike (model info, program lists)."""
        if not any(
            request.url.path == p or request.url.path.startswith(p + "/") for p in _PASS_GET
        ):
            raise APIError(404, f"{request.url.path}: no such route")
        out = await self.replica.call.remote(
            "GET", request.url.path, "", b"", forward_headers(request.headers)
        )
        return Response(out["body"], status_code=out["status"], media_type=out["content_type"])

    async def _forward(self, request: Request, key_of: Any) -> Response:
        raw = await request.body()
        body = await read_object(request)
        args = (
            request.method,
            request.url.path,
            key_of(body),
            raw,
            forward_headers(request.headers),
        )
        if body.get("stream") is True:
            return await self._stream(args)
        return await self._call(args)

    async def _call(self, args: tuple) -> Response:
        errors = []
        for _ in range(self.max_attempts):
            try:
                out = await self.replica.call.remote(*args)
            except _REPLICA_DIED as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            return Response(out["body"], status_code=out["status"], media_type=out["content_type"])
        raise _unavailable(errors)

    async def _stream(self, args: tuple) -> Response:
        errors = []
        for _ in range(self.max_attempts):
            chunks = self.replica.options(stream=True).stream.remote(*args)
            try:
                head = await chunks.__anext__()
                first = await anext(chunks, b"")
            except _REPLICA_DIED as e:  # nothing reached the client yet: try another replica
                errors.append(f"{type(e).__name__}: {e}")
                continue
            if head["status"] != 200:
                rest = [first] + [c async for c in chunks]
                return Response(
                    b"".join(rest), status_code=head["status"], media_type=head["content_type"]
                )
            return StreamingResponse(
                _relay(first, chunks, args[1]),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        raise _unavailable(errors)


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The Serve application. `args`: any `Engine(...)` keyword (`model_path`, `page_size`, ...),
    `programs` (files or modules), `num_replicas` (fixed) or `autoscaling_config` (Serve's:
    `min_replicas`, `max_replicas`, `target_ongoing_requests` — the queue length per replica it
    scales on), `max_ongoing_requests`, `replica_cpus`, `replica_gpus`, and `router` (plait's
    `RouterConfig` fields: `cache_threshold`, `balance_abs_threshold`, ...)."""
    args = dict(args or {})
    programs = tuple(args.pop("programs", ()) or ())
    router = dict(args.pop("router", {}) or {})
    unknown = sorted(set(router) - set(_ROUTER_KEYS))
    if unknown:
        raise ValueError(
            f"router.{unknown[0]}: unknown; the router takes {', '.join(_ROUTER_KEYS)}"
        )
    options: dict[str, Any] = {
        "ray_actor_options": {
            "num_cpus": args.pop("replica_cpus", 1),
            "num_gpus": args.pop("replica_gpus", 0),
        },
        "max_ongoing_requests": args.pop("max_ongoing_requests", 64),
        "request_router_config": RequestRouterConfig(
            request_router_class="plait.deploy.ray_routing.PlaitRequestRouter",
            request_router_kwargs=router,
        ),
    }
    if "autoscaling_config" in args:
        options["autoscaling_config"] = args.pop("autoscaling_config")
    else:
        options["num_replicas"] = args.pop("num_replicas", 1)
    from plait.runtime.config import EngineConfig

    EngineConfig.from_kwargs(**args)  # a bad engine argument fails here, not in every replica
    replica = serve.deployment(PlaitReplica, name="PlaitReplica", **options)
    ingress = serve.deployment(
        PlaitIngress, name="PlaitIngress", num_replicas=1, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(replica.bind(args, programs))
