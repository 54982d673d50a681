"""The router's Prometheus metrics: routing decisions, retries, failures, and each replica's
health (how often it went down), load and prefix-tree size read live at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from plait.server.handoff_proxy import HandoffMetrics
from plait.server.routing import Decision, Router


class _ReplicaCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily(
            "plait_router_replica_up", "1 if the replica is routed to", labels=["replica"]
        )
        load = GaugeMetricFamily(
            "plait_router_replica_in_flight",
            "requests the router has in flight on the replica",
            labels=["replica"],
        )
        tree = GaugeMetricFamily(
            "plait_router_replica_tree_chars",
            "characters of prompt text the router believes the replica caches",
            labels=["replica"],
        )
        downs = CounterMetricFamily(
            "plait_router_replica_downs",
            "times the replica was marked "
            "down (failed forwards, failed health probes, its process "
            "gone)",
            labels=["replica"],
        )
        for r in self.router.replicas:
            up.add_metric([r.url], 1.0 if r.healthy else 0.0)
            load.add_metric([r.url], r.in_flight)
            tree.add_metric([r.url], r.tree.num_chars)
            downs.add_metric([r.url], r.downs)
        yield from (up, load, tree, downs)
        yield GaugeMetricFamily(
            "plait_router_healthy_replicas", "replicas routed to", value=len(self.router.healthy())
        )


class RouterMetrics:
    def __init__(self, router: Router) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter(
            "plait_router_requests",
            "requests routed, by replica and reason",
            ["replica", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "plait_router_retries",
            "attempts that failed and moved on from the replica",
            ["replica"],
            registry=r,
        )
        self.replica_failures = Counter(
            "plait_router_replica_failures",
            "connection failures that marked the replica down",
            ["replica"],
            registry=r,
        )
        self.prompt_chars = Counter(
            "plait_router_prompt_chars", "characters of routed prompts", registry=r
        )
        self.matched_chars = Counter(
            "plait_router_matched_chars",
            "prompt characters the chosen replica's prefix tree already held",
            registry=r,
        )
        self.handoff = HandoffMetrics(r)
        r.register(_ReplicaCollector(router))

    def observe_route(self, decision: Decision, key_chars: int) -> None:
        self.routed.labels(decision.replica.url, decision.reason).inc()
        self.prompt_chars.inc(key_chars)
        self.matched_chars.inc(decision.matched_chars)

    def render(self) -> bytes:
        return generate_latest(self.registry)
