"""`--api-key`: every route but `/health` needs `Authorization: Bearer <key>`."""

from __future__ import annotations

import hashlib
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from plait.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = _digest(f"Bearer {api_key}".encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        # NOTE: digests of equal length, so the comparison time says nothing about the key,
        # not even its length.
        if not secrets.compare_digest(_digest(given), self.expected):
            reason = "missing" if not given else "invalid"
            error = APIError(
                401,
                f"authorization: {reason} API key; send 'Authorization: Bearer <key>'",
                param="authorization",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()
