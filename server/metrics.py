"""Prometheus metrics: counters and latency histograms the server observes, plus every numeric
figure of `engine.stats()` read live at scrape time (so new engine counters such as jump-forward
or speculative acceptance appear without a server change)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

disable_created_metrics()  # the `*_created` timestamp series only add noise to a scrape

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)


class StreamTimer:
    """Time to first token and inter-token latency of one streamed request."""

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.metrics = metrics
        self.last_time = start
        self.last_tokens = 0

    def tick(self, completion_tokens: int, now: float) -> None:
        new = completion_tokens - self.last_tokens
        if new <= 0:
            return
        if self.last_tokens == 0:
            self.metrics.ttft.observe(now - self.last_time)
        elif new > 0:
            per_token = (now - self.last_time) / new
            for _ in range(min(new, 64)):
                self.metrics.itl.observe(per_token)
        self.last_time, self.last_tokens = now, completion_tokens


class _EngineCollector(Collector):
    def __init__(self, engine: Any, admission: Any) -> None:
        self.engine = engine
        self.admission = admission

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.engine.stats()
        for key, value in sorted(stats.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            yield GaugeMetricFamily(f"plait_engine_{key}", f"engine.stats()['{key}']", value=value)
        total = stats.get("kv_pages_total") or 0
        if total:
            used = stats.get("kv_pages_in_use", 0) / total
            yield GaugeMetricFamily(
                "plait_kv_cache_usage_ratio", "KV pages held by running requests / pool", value=used
            )
        yield GaugeMetricFamily(
            "plait_num_running_requests",
            "requests in the running batch",
            value=stats.get("num_running", 0),
        )
        yield GaugeMetricFamily(
            "plait_num_queued_requests",
            "requests waiting to be scheduled",
            value=stats.get("num_waiting", 0),
        )
        yield GaugeMetricFamily(
            "plait_cache_hit_rate",
            "cached prompt tokens / prompt tokens, since start",
            value=stats.get("cache_hit_rate", 0.0),
        )
        yield from _tier_metrics(stats)
        yield GaugeMetricFamily(
            "plait_server_in_flight_requests",
            "engine requests admitted by the server",
            value=self.admission.in_flight,
        )


_TIER_FIGURES = {
    "blocks": "KV blocks stored in the tier (as far as this engine knows)",
    "bytes": "bytes of KV blocks stored in the tier (as far as this engine knows)",
    "hit_rate": "blocks found / blocks looked up in the tier",
    "promotions": "blocks loaded from the tier into the KV pool",
    "demotions": "blocks written to the tier",
    "load_seconds_mean": "mean time of one read of blocks from the tier",
    "failures": "blocks the tier could not read or write (each a miss)",
}


def _tier_metrics(stats: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
    """One family per figure, labelled by tier (`disk`, `redis`); failures also by kind."""
    tiers = [t for t in str(stats.get("kv_tiers") or "").split(",") if t]
    if not tiers:
        return
    for figure, doc in _TIER_FIGURES.items():
        family = GaugeMetricFamily(f"plait_kv_tier_{figure}", doc, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier], stats.get(f"kv_{tier}_{figure}", 0))
        yield family
    kinds = GaugeMetricFamily(
        "plait_kv_tier_failures_by_kind", "tier failures by kind", labels=["tier", "kind"]
    )
    prefix = "failures_"
    for tier in tiers:
        for key, value in stats.items():
            if key.startswith(f"kv_{tier}_{prefix}"):
                kinds.add_metric([tier, key.removeprefix(f"kv_{tier}_{prefix}")], value)
    yield kinds


class ServerMetrics:
    """One registry per app (tests start several servers in one process)."""

    def __init__(self, engine: Any, admission: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "plait_requests",
            "finished generation requests",
            ["endpoint", "finish_reason"],
            registry=r,
        )
        self.errors = Counter("plait_request_errors", "error responses", ["status"], registry=r)
        self.prompt_tokens = Counter("plait_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("plait_generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter(
            "plait_cached_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        self.ttft = Histogram(
            "plait_time_to_first_token_seconds",
            "time to first token (streamed requests)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "plait_inter_token_latency_seconds",
            "time between output tokens (streamed requests)",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "plait_e2e_request_latency_seconds",
            "arrival to finish, per engine request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.program_runs = Counter(
            "plait_program_runs", "program endpoint runs", ["program", "outcome"], registry=r
        )
        r.register(_EngineCollector(engine, admission))

    def stream_timer(self, start: float) -> StreamTimer:
        return StreamTimer(self, start)

    def observe_finished(self, endpoint: str, meta: dict[str, Any]) -> None:
        reason = (meta.get("finish_reason") or {}).get("type", "unknown")
        self.requests.labels(endpoint, reason).inc()
        self.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        self.generation_tokens.inc(meta.get("completion_tokens", 0))
        self.cached_tokens.inc(meta.get("cached_tokens", 0))
        if meta.get("e2e_latency") is not None:
            self.e2e.observe(meta["e2e_latency"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
