"""The router's part in prefill–decode disaggregation: before a request goes to its decode
replica, its prefill half goes to a prefill replica, which pushes the prompt's KV straight to
that decode replica (server/kv_handoff.py); then `Proxy` forwards the request as usual.

The prefill half never fails a request: a prefill replica that cannot be reached, is full or
fails is skipped (marked down when it cannot be reached) and the decode replica prefills the
prompt itself. Only a prefill replica's 4xx, which the decode replica would answer alike (the
request is checked the same way on both), is the client's answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter

from plait.server.calls import ClientGone, until_disconnect
from plait.server.kv_handoff import HANDOFF_HEADER
from plait.server.routing import NoReplicaError, Replica, Router

logger = logging.getLogger("plait.router")

PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
_NOT_PREFILLED = ("stream", "stream_options")  # the prefill half is answered in one piece


class HandoffMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.handoffs = Counter(
            "plait_router_kv_handoffs",
            "prefill halves sent, by prefill "
            "replica and outcome (ok, push_failed, prefill_failed, "
            "no_prefill_replica)",
            ["replica", "outcome"],
            registry=r,
        )
        self.bytes = Counter(
            "plait_router_kv_handoff_bytes",
            "KV bytes pushed from prefill to decode replicas",
            registry=r,
        )
        self.tokens = Counter(
            "plait_router_kv_handoff_tokens", "prompt tokens whose KV was pushed", registry=r
        )
        self.push_seconds = Counter(
            "plait_router_kv_handoff_push_seconds",
            "time prefill replicas spent pushing KV",
            registry=r,
        )
        self.prefill_seconds = Counter(
            "plait_router_kv_handoff_prefill_seconds",
            "time prefill replicas spent prefilling",
            registry=r,
        )


class HandoffProxy:
    def __init__(
        self,
        router: Router,
        client: httpx.AsyncClient,
        metrics: HandoffMetrics,
        failed: Callable[[Replica, Exception], None],
    ) -> None:
        self.router = router
        self.client = client
        self.metrics = metrics
        self.failed = failed  # marks a replica down that could not be reached

    async def prefill(
        self,
        request: Request,
        path: str,
        body: dict[str, Any],
        key: str,
        decode: Replica,
        headers: dict[str, str],
    ) -> Response | None:
        """Has a prefill replica prefill the request for `decode`; a response only when it is the
        client's answer (a 4xx, or a 499 when the client left)."""
        m = self.metrics
        try:
            replica = self.router.choose(key, prefill=True).replica
        except NoReplicaError:
            m.handoffs.labels("", "no_prefill_replica").inc()
            return None
        half = json.dumps({k: v for k, v in body.items() if k not in _NOT_PREFILLED})
        upstream = {**headers, HANDOFF_HEADER: decode.url, "content-type": "application/json"}
        # NOTE: the decode replica counts the request from now: routing balances on in_flight
        replica.in_flight += 1
        decode.in_flight += 1
        try:
            reply = await until_disconnect(
                request, self.client.post(replica.url + path, content=half, headers=upstream)
            )
        except httpx.TransportError as exc:
            self.failed(replica, exc)
            m.handoffs.labels(replica.url, "prefill_failed").inc()
            return None
        except ClientGone:
            return Response(status_code=499)
        finally:
            replica.in_flight -= 1
            decode.in_flight -= 1
        replica.served += 1
        if reply.status_code != 200:
            m.handoffs.labels(replica.url, "prefill_failed").inc()
            if 400 <= reply.status_code < 500 and reply.status_code not in (408, 429):
                keep = ("content-type", "www-authenticate")
                kept = {k: v for k, v in reply.headers.items() if k.lower() in keep}
                return Response(reply.content, status_code=reply.status_code, headers=kept)
            logger.warning(
                "prefill replica %s answered %d; %s prefills the request itself",
                replica.url,
                reply.status_code,
                decode.url,
            )
            return None
        summary = reply.json().get("kv_handoff") or {}
        m.handoffs.labels(replica.url, "push_failed" if summary.get("error") else "ok").inc()
        m.bytes.inc(summary.get("bytes", 0))
        m.tokens.inc(summary.get("imported_tokens", 0))
        m.push_seconds.inc(summary.get("push_ms", 0.0) / 1000)
        m.prefill_seconds.inc(summary.get("prefill_ms", 0.0) / 1000)
        return None
