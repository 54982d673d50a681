"""`/dashboard` on the data-parallel router: the same page, with a view per replica.

`GET /dashboard/snapshot?replica=I` is replica I's own snapshot (fetched with the caller's
headers, so its API key applies), plus `router`: every replica's health and load and the one
shown. A replica that does not answer gives a snapshot with only `router` and `error`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from plait.server.dashboard_page import DashboardPage
from plait.server.proxy import forward_headers


def install_router_dashboard(app: FastAPI, state: Any) -> None:
    """Call it last, after the API-key middleware: the static page is served before the check."""

    @app.get("/dashboard/snapshot")
    async def snapshot(
        request: Request,
        replica: int = Query(0, ge=0, description="which replica's view"),
        since: int | None = Query(None, ge=0),
        nodes: int | None = Query(None, ge=1, le=1000),
    ) -> JSONResponse:
        replicas = state.router.replicas
        index = min(replica, len(replicas) - 1)
        target = replicas[index]
        info = {
            "replicas": [{"index": i, **r.describe()} for i, r in enumerate(replicas)],
            "selected": index,
            "policy": state.router.config.policy,
        }
        params = {k: v for k, v in (("since", since), ("nodes", nodes)) if v is not None}
        try:
            resp = await state.proxy.client.get(
                target.url + "/dashboard/snapshot",
                params=params,
                headers=forward_headers(request.headers),
                timeout=10.0,
            )
        except httpx.HTTPError as e:
            return _unavailable(
                info, f"replica {target.url} did not answer: {type(e).__name__}: {e}"
            )
        if resp.status_code == 401:  # the router's own key check passed: the replica's differs
            return Response(resp.content, status_code=401, media_type="application/json")
        if resp.status_code != 200:
            return _unavailable(info, f"replica {target.url} answered {resp.status_code}")
        body = json.loads(resp.content)
        body["router"] = info
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    app.add_middleware(DashboardPage)


def _unavailable(info: dict[str, Any], message: str) -> JSONResponse:
    body = {"kind": "router", "router": info, "error": message}
    return JSONResponse(body, headers={"Cache-Control": "no-store"})
