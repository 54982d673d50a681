"""Forwarding one HTTP request to the replica the `Router` chooses, with failover.

A replica that cannot be reached, or dies before the response started, is marked down and the
request is sent to another one (it is safe: nothing reached the client). A streamed response
is held back until its first chunk arrived, so a replica dying during prefill is retried too;
once a chunk went out, a failure ends the stream with an SSE error event that names the replica.
A replica answering 503 (its queue is full) is skipped for the next one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from plait.server.calls import ClientGone, until_disconnect
from plait.server.errors import APIError
from plait.server.handoff_proxy import PATHS as HANDOFF_PATHS
from plait.server.handoff_proxy import HandoffProxy
from plait.server.kv_handoff import HANDOFF_HEADER
from plait.server.routing import Decision, NoReplicaError, Replica, Router

logger = logging.getLogger("plait.router")

# Hop-by-hop and body-framing headers are the proxy's own business, not the replica's.
_DROP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "accept-encoding",
        HANDOFF_HEADER,
    }
)


def forward_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_HEADERS}


class Proxy:
    def __init__(self, router: Router, metrics: Any) -> None:
        self.router = router
        self.metrics = metrics
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(None, connect=5.0)  # generation takes as long as it takes
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.handoffs = HandoffProxy(router, self.client, metrics.handoff, self._failed)

    async def forward(
        self,
        request: Request,
        path: str,
        raw: bytes,
        key: str,
        stream: bool,
        body: dict[str, Any] | None = None,
    ) -> Response:
        """The chosen replica's response; with prefill replicas, a generation request (`body`)
        is prefilled on one of them first (`HandoffProxy`)."""
        session = request.headers.get("x-plait-session")
        tried: set[str] = set()
        errors: list[str] = []
        for _ in range(self.router.config.max_attempts):
            try:
                decision = self.router.choose(key, session, frozenset(tried))
            except NoReplicaError as e:
                errors.append(str(e))
                break
            replica = decision.replica
            tried.add(replica.url)
            self.metrics.observe_route(decision, len(key))
            if (
                body is not None
                and replica.role == "decode"
                and path in HANDOFF_PATHS
                and len(key) >= self.router.config.prefill_min_chars
            ):
                headers = forward_headers(request.headers)
                answer = await self.handoffs.prefill(request, path, body, key, replica, headers)
                if answer is not None:
                    return answer
            outcome = await self._attempt(request, path, raw, decision, stream)
            if isinstance(outcome, Response):
                return outcome
            errors.append(outcome)
            self.metrics.retries.labels(replica.url).inc()
        raise APIError(
            503 if not errors or "no healthy replica" in errors[-1] else 502,
            "router: the request could not be served by any replica: " + "; ".join(errors),
            type="replica_error",
            headers={"Retry-After": "1"},
        )

    async def _attempt(
        self, request: Request, path: str, raw: bytes, decision: Decision, stream: bool
    ) -> Response | str:
        """A response for the client, or why this replica could not give one (try another)."""
        replica = decision.replica
        replica.in_flight += 1
        upstream = self.client.build_request(
            request.method,
            replica.url + path,
            content=raw,
            params=request.query_params,
            headers=forward_headers(request.headers),
        )
        resp: httpx.Response | None = None
        handed_off = False  # the streaming relay releases the replica when it ends
        try:
            resp = await until_disconnect(request, self._send(upstream))
            if resp.status_code == 503 and len(self.router.healthy()) > 1:
                return f"{replica.url} is at capacity (503)"
            if stream and resp.status_code == 200:
                chunks = resp.aiter_bytes()
                first = await until_disconnect(request, anext(chunks, b""))
                lease = _Lease(replica)
                relay = self._relay(lease, resp, chunks, first, path)
                # NOTE: a response dropped before its first chunk never enters the relay's finally.
                weakref.finalize(relay, lease.release)
                handed_off = True
                replica.served += 1
                return StreamingResponse(
                    relay, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            body = await until_disconnect(request, resp.aread())
            replica.served += 1
            return Response(body, status_code=resp.status_code, headers=_reply_headers(resp))
        except httpx.TransportError as e:
            self._failed(replica, e)
            return f"{replica.url}: {type(e).__name__}: {e}"
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_off:
                replica.in_flight -= 1
                if resp is not None:
                    await resp.aclose()

    async def _send(self, upstream: httpx.Request) -> httpx.Response:
        try:
            return await self.client.send(upstream, stream=True)
        except AttributeError as e:
            # NOTE: a replica killed while its connection opens can leave httpcore asking anyio for
            # the peer of a socket that is already gone ('NoneType' has no 'getpeername'): an
            # unreachable replica like any other, not a bug of the request.
            raise httpx.ConnectError(
                f"the connection closed while opening ({e})", request=upstream
            ) from e

    async def _relay(
        self,
        lease: _Lease,
        resp: httpx.Response,
        chunks: AsyncIterator[bytes],
        first: bytes,
        path: str,
    ) -> AsyncIterator[bytes]:
        replica = lease.replica
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as e:
            self._failed(replica, e)
            yield stream_error(replica.url, e, path)
        finally:
            lease.release()
            await resp.aclose()

    def _failed(self, replica: Replica, error: Exception) -> None:
        message = f"{type(error).__name__}: {error}"
        logger.warning("replica %s failed (%s); routing around it", replica.url, message)
        self.router.mark_down(replica, message)
        self.metrics.replica_failures.labels(replica.url).inc()

    async def any_replica(self, request: Request, path: str) -> Response:
        """GET-style routes every replica answers alike (model info, program lists)."""
        return await self.forward(request, path, await request.body(), "", stream=False)

    async def broadcast(self, request: Request, path: str) -> list[tuple[str, int, bytes]]:
        """Sends the request to every healthy replica: [(url, status, body)]."""
        raw = await request.body()
        headers = forward_headers(request.headers)

        async def one(replica: Replica) -> tuple[str, int, bytes]:
            try:
                r = await self.client.request(
                    request.method, replica.url + path, content=raw, headers=headers
                )
                return replica.url, r.status_code, r.content
            except httpx.TransportError as e:
                self._failed(replica, e)
                return replica.url, 502, str(e).encode()

        return list(await asyncio.gather(*(one(r) for r in self.router.healthy())))

    async def aclose(self) -> None:
        await self.client.aclose()


def stream_error(url: str, error: Exception, path: str) -> bytes:
    message = (
        f"replica {url} failed after the response started streaming "
        f"({type(error).__name__}: {error}); the request was not retried"
    )
    payload: dict[str, Any] = {
        "error": {"message": message, "type": "replica_error", "param": None, "code": 502}
    }
    if path.startswith("/programs/"):
        payload = {"event": "error", "message": message, "type": "replica_error"}
    return f"data: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode()


def _reply_headers(resp: httpx.Response) -> dict[str, str]:
    keep = ("content-type", "retry-after", "www-authenticate")
    return {k: v for k, v in resp.headers.items() if k.lower() in keep}


class _Lease:
    """One request's share of a replica's load, given back exactly once."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.replica.in_flight -= 1
