"""The router's proxy without replicas' processes: a mock transport stands in for them."""

from __future__ import annotations

import asyncio

import httpx
from starlette.requests import Request

from plait.server.prefix_tree import PrefixTree
from plait.server.proxy import Proxy
from plait.server.router_metrics import RouterMetrics
from plait.server.routing import Replica, Router, RouterConfig


def _request() -> Request:
    async def receive() -> dict:
        await asyncio.sleep(3600)  # the client never leaves
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/generate",
        "headers": [],
        "query_string": b"",
    }
    return Request(scope, receive)


def test_a_socket_torn_down_while_connecting_routes_around_the_replica():
    dead, live = Replica("http://dead:1", PrefixTree()), Replica("http://live:2", PrefixTree())
    router = Router(RouterConfig(policy="round_robin"), [dead, live])
    proxy = Proxy(router, RouterMetrics(router))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "dead":  # what httpcore raised when a replica died mid-connect
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        return httpx.Response(200, json={"text": "ok"})

    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))

    async def run() -> list[httpx.Response]:
        return [
            await proxy.forward(_request(), "/generate", b"{}", "", stream=False) for _ in range(2)
        ]

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200, 200]
    assert (
        dead.healthy is False
        and "ConnectError" in dead.last_error
        and "getpeername" in dead.last_error
    )
    assert live.served == 2 and dead.in_flight == live.in_flight == 0
