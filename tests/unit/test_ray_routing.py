"""`PlaitRequestRouter` (plait's policy inside Ray Serve's handles) without a Ray cluster: fake
replicas and queue lengths stand in for Serve's. Skipped when `ray[serve]` is not installed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")


def _router(queue_lens: dict[str, int]):
    from plait.deploy.ray_routing import PlaitRequestRouter

    router = PlaitRequestRouter.__new__(PlaitRequestRouter)  # Serve's constructor needs a cluster
    router.initialize_state(balance_abs_threshold=2)
    router._replica_queue_len_cache = SimpleNamespace(get=lambda rid: queue_lens.get(rid.unique_id))
    return router


def _replica(name: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


def _choose(router, replicas, key: str, headers: dict | None = None):
    pending = SimpleNamespace(args=["POST", "/generate", key, b"{}", headers or {}])
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return ranks[0][0].replica_id.unique_id, ranks


def test_prefixes_follow_their_replica_until_load_is_imbalanced():
    loads = {"a": 0, "b": 0}
    router = _router(loads)
    replicas = [_replica("a"), _replica("b")]
    first, ranks = _choose(router, replicas, "system prompt one. question 1")
    assert len(ranks) == 2 and ranks[1][0].replica_id.unique_id != first  # a fallback rank
    loads[first] = 1
    assert _choose(router, replicas, "system prompt one. question 2")[0] == first
    other = _choose(router, replicas, "a different prompt entirely")[0]
    assert other != first
    loads[first] = 5  # 5 - 0 > 2: the idle replica takes it despite the prefix
    assert _choose(router, replicas, "system prompt one. question 3")[0] == other


def test_replicas_that_leave_are_forgotten_and_sessions_stick():
    router = _router({})
    a, b = _replica("a"), _replica("b")
    pinned = _choose(router, [a, b], "x", {"x-plait-session": "run-7"})[0]
    assert all(
        _choose(router, [a, b], f"y{i}", {"x-plait-session": "run-7"})[0] == pinned
        for i in range(3)
    )
    survivor = b if pinned == "a" else a
    assert _choose(router, [survivor], "x", {"x-plait-session": "run-7"})[0] != pinned
    assert [r.url for r in router.policy.replicas] == [survivor.replica_id.unique_id]
