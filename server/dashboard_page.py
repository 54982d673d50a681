"""The dashboard's page: one HTML response with its script and style inlined, served before the
API-key check (it holds no data; the snapshot it polls needs the key)."""

from __future__ import annotations

from importlib import resources

from starlette.types import ASGIApp, Receive, Scope, Send

PAGE_PATH = "/dashboard"


def page_html() -> bytes:
    """The page, its script and style inlined: one response, nothing fetched from elsewhere."""
    static = resources.files("plait.server") / "static"
    html = (static / "dashboard.html").read_text()
    html = html.replace("/*STYLE*/", (static / "dashboard.css").read_text())
    html = html.replace("/*SCRIPT*/", (static / "dashboard.js").read_text())
    return html.encode()


class DashboardPage:
    """Pure ASGI: answers `GET /dashboard` with the static page; everything else passes on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._body = page_html()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != PAGE_PATH
            or scope["method"] not in ("GET", "HEAD")
        ):
            await self.app(scope, receive, send)
            return
        headers = [
            (b"content-type", b"text/html; charset=utf-8"),
            (b"content-length", str(len(self._body)).encode()),
            (b"cache-control", b"no-cache"),
            (
                b"content-security-policy",
                b"default-src 'self'; script-src 'unsafe-inline'; "
                b"style-src 'unsafe-inline'; img-src 'self' data:",
            ),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        body = b"" if scope["method"] == "HEAD" else self._body
        await send({"type": "http.response.body", "body": body})
