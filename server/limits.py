"""Request limits checked before a route runs: header count and size (431) and a declared body
size (413). Bodies sent without a length are counted as they are read (`errors.read_json`).

Pure ASGI, like the API-key check, so streaming responses and disconnects pass through untouched.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from plait.server.errors import APIError, body_too_large

MAX_HEADERS = 100
MAX_HEADER_BYTES = 32 << 10  # names and values of all headers together
# NOTE: uvicorn's h11 protocol refuses a header block past 16 KiB before the app sees it; with
# httptools (picked automatically once installed, as Ray installs it) a header block that never
# ends was buffered until the client gave up. Every plait server names h11 explicitly.
UVICORN_HTTP = "h11"
# NOTE: how long an idle keep-alive connection stays open. Longer than clients keep theirs
# (httpx, and so the `openai` client, drop an idle connection after 5 s; uvicorn's own default is
# also 5 s): otherwise a client may send its next request on a connection the server is closing at
# that moment and get a reset instead of an answer (which httpx raises as `ReadError`).
KEEP_ALIVE_SECONDS = 75


class LimitsMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, exempt: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.exempt = exempt  # paths whose route limits its body itself

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_limit = scope["path"] not in self.exempt
        error = self.check(scope.get("headers") or [], body_limit)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def check(self, headers: list[tuple[bytes, bytes]], body_limit: bool = True) -> APIError | None:
        size = sum(len(k) + len(v) for k, v in headers)
        if len(headers) > MAX_HEADERS or size > MAX_HEADER_BYTES:
            return APIError(
                431,
                f"headers: {len(headers)} headers of {size} bytes; the limits are "
                f"{MAX_HEADERS} headers and {MAX_HEADER_BYTES} bytes",
                param="headers",
            )
        for name, value in headers:
            if name == b"content-length" and body_limit:
                try:
                    declared = int(value)
                except ValueError:
                    return APIError(400, "content-length: not an integer", param="content-length")
                if declared > self.max_body_bytes:
                    return body_too_large(self.max_body_bytes)
        return None
