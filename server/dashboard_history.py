"""The dashboard's figures over time: one row per sample, kept in a ring.

A row holds the engine's gauges as `engine.stats()` names them (`num_running`, `kv_pages_free`,
`cache_hit_rate`, ...) and figures of the interval since the previous row: `window_hit_rate`,
`output_tokens_per_s`, token counts per step by kind, step time, and TTFT / inter-token latency
percentiles over the trailing `LATENCY_WINDOW_S`. Rows are taken when someone asks for a
snapshot, at most one per `interval` seconds: nothing is sampled while nobody watches.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

LATENCY_WINDOW_S = 10.0

GAUGES = (
    "num_running",
    "num_waiting",
    "kv_pages_total",
    "kv_pages_free",
    "kv_pages_cached",
    "kv_pages_evictable",
    "kv_pages_in_use",
    "cache_hit_rate",
    "num_retracted",
    "total_generated_tokens",
    "total_computed_tokens",
    "spec_acceptance_rate",
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0..1) by the nearest-rank method; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered) - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


class History:
    def __init__(self, maxlen: int = 600, interval: float = 1.0) -> None:
        self.rows: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self.interval = interval
        self._seq = itertools.count(1)
        self._last: dict[str, Any] | None = None

    def due(self, now: float, interval: float | None = None) -> bool:
        step = self.interval if interval is None else interval
        return self._last is None or now - self._last["time"] >= step

    def sample(
        self,
        now: float,
        stats: dict[str, Any],
        prompt_tokens: int,
        cached_prompt_tokens: int,
        steps: Iterable[Any] = (),
        ttft: Iterable[tuple[float, float]] = (),
        itl: Iterable[tuple[float, float]] = (),
        events: Iterable[dict[str, Any]] = (),
        retracted_waiting: int = 0,
    ) -> dict[str, Any]:
        """Appends and returns one row. `steps` are `StepRecord`s, `ttft` / `itl` (time, seconds)
        pairs and `events` the probe's; each may hold more than the interval (filtered here)."""
        last = self._last
        start = last["time"] if last is not None else now - self.interval
        row: dict[str, Any] = {"seq": next(self._seq), "time": now}
        for key in GAUGES:
            value = stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[key] = value
        row["kv_pages_protected"] = stats.get("kv_pages_cached", 0) - stats.get(
            "kv_pages_evictable", 0
        )
        row["num_retracted_waiting"] = retracted_waiting
        row["prompt_tokens"], row["cached_prompt_tokens"] = prompt_tokens, cached_prompt_tokens
        row.update(self._interval_figures(row, last, now - start))
        row.update(_step_figures([s for s in steps if start < s.time <= now]))
        window = now - LATENCY_WINDOW_S
        recent_ttft = [v for t, v in ttft if t > window]
        recent_itl = [v for t, v in itl if t > window]
        for name, values in (("ttft", recent_ttft), ("itl", recent_itl)):
            row[f"{name}_p50_s"] = percentile(values, 0.5)
            row[f"{name}_p99_s"] = percentile(values, 0.99)
        mine = [e for e in events if start < e["time"] <= now]
        row["evicted_pages"] = sum(e.get("pages", 0) for e in mine if e["kind"] == "evict")
        row["retractions_seen"] = sum(1 for e in mine if e["kind"] == "retract")
        self.rows.append(row)
        self._last = row
        return row

    def since(self, seq: int | None) -> list[dict[str, Any]]:
        if seq is None:
            return list(self.rows)
        return [r for r in self.rows if r["seq"] > seq]

    @staticmethod
    def _interval_figures(
        row: dict[str, Any], last: dict[str, Any] | None, seconds: float
    ) -> dict[str, Any]:
        if last is None or seconds <= 0:
            return {"window_hit_rate": None, "output_tokens_per_s": None, "retractions": 0}
        prompt = row["prompt_tokens"] - last["prompt_tokens"]
        cached = row["cached_prompt_tokens"] - last["cached_prompt_tokens"]
        generated = row.get("total_generated_tokens", 0) - last.get("total_generated_tokens", 0)
        retracted = row.get("num_retracted", 0) - last.get("num_retracted", 0)
        return {
            "window_hit_rate": cached / prompt if prompt > 0 else None,
            "output_tokens_per_s": max(generated, 0) / seconds,
            "retractions": max(retracted, 0),
        }


def _step_figures(steps: list[Any]) -> dict[str, Any]:
    """Sums over the interval's steps, and tokens per step by kind (prefill chunks, decode,
    speculative verify, jump-forward)."""
    n = len(steps)
    kinds = ("prefill", "decode", "verify", "jump_forward")
    out: dict[str, Any] = {"steps": n}
    for kind in kinds:
        total = sum(getattr(s, kind) for s in steps)
        out[f"{kind}_tokens"] = total
        out[f"{kind}_tokens_per_step"] = total / n if n else None
    timed = [s.seconds / max(s.decode_steps, 1) for s in steps if s.seconds is not None]
    out["step_time_ms"] = sum(timed) / len(timed) * 1000 if timed else None
    out["step_time_p99_ms"] = (percentile(timed, 0.99) or 0) * 1000 if timed else None
    out["batch_size"] = sum(s.batch_size for s in steps) / n if n else None
    return out
