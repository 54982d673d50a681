"""`PlaitRequestRouter`: plait's cache-aware policy (`plait.server.routing.Router`) as a Ray Serve
request router, so Serve's own handles send each request to the replica holding its prefix.

The ingress passes the request's route key (its prompt text, `plait.server.route_keys`) as the
third argument of every replica call; the router reads it from the pending request. Replica
load is Serve's queue-length cache (ongoing requests per replica).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from plait.server.prefix_tree import PrefixTree
from plait.server.routing import Replica, Router, RouterConfig


class PlaitRequestRouter(RequestRouter):
    def initialize_state(self, **config: Any) -> None:
        self.policy = Router(RouterConfig(**config), [])

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self._sync(by_id)
        key = _route_key(pending_request)
        session = _session(pending_request)
        decision = self.policy.choose(key, session)
        chosen = by_id[decision.replica.url]
        others = [r for r in candidate_replicas if r is not chosen]
        return [[chosen], others] if others else [[chosen]]

    def _sync(self, by_id: dict[str, RunningReplica]) -> None:
        """The policy's replicas become Serve's current ones, with their queue lengths."""
        known = {r.url: r for r in self.policy.replicas}
        replicas = []
        for rid, running in by_id.items():
            replica = known.get(rid) or Replica(rid, PrefixTree(self.policy.config.max_tree_chars))
            replica.in_flight = self.replica_queue_len_cache.get(running.replica_id) or 0
            replicas.append(replica)
        self.policy.replicas = replicas


def _route_key(pending: PendingRequest | None) -> str:
    if pending is None or len(pending.args) < 3 or not isinstance(pending.args[2], str):
        return ""
    return pending.args[2]


def _session(pending: PendingRequest | None) -> str | None:
    if pending is None or len(pending.args) < 5 or not isinstance(pending.args[4], dict):
        return None
    return pending.args[4].get("x-plait-session")
