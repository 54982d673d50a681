"""The dashboard's history rows: interval figures from counter deltas, steps split by kind,
latency percentiles over the trailing window, and the step probe on a fake scheduler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plait.runtime.batch import ExtendEntry, ScheduleBatch
from plait.server.dashboard_history import History, percentile
from plait.server.dashboard_probe import StepProbe, StepRecord


def _stats(**kw):
    base = {
        "num_running": 0,
        "num_waiting": 0,
        "kv_pages_total": 100,
        "kv_pages_free": 100,
        "kv_pages_cached": 0,
        "kv_pages_evictable": 0,
        "kv_pages_in_use": 0,
        "cache_hit_rate": 0.0,
        "num_retracted": 0,
        "total_generated_tokens": 0,
        "quantization": None,
    }
    return {**base, **kw}


def _step(t: float, **kw) -> StepRecord:
    base = dict(
        time=t,
        seconds=0.01,
        prefill=0,
        decode=0,
        verify=0,
        accepted=0,
        jump_forward=0,
        decode_steps=1,
        batch_size=1,
    )
    return StepRecord(**{**base, **kw})


def test_percentile_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.99) == 99.0


def test_rows_take_deltas_and_split_steps():
    h = History(maxlen=3, interval=1.0)
    first = h.sample(100.0, _stats(), prompt_tokens=0, cached_prompt_tokens=0)
    assert first["window_hit_rate"] is None and first["output_tokens_per_s"] is None
    assert not h.due(100.5) and h.due(101.0)
    steps = [
        _step(100.5, prefill=30, decode=2),
        _step(101.5, decode=4, jump_forward=3),
        _step(101.9, verify=6, accepted=2, decode=1, seconds=None),
        _step(99.0, prefill=999),
    ]
    row = h.sample(
        102.0,
        _stats(
            kv_pages_cached=10, kv_pages_evictable=4, total_generated_tokens=50, num_retracted=1
        ),
        prompt_tokens=200,
        cached_prompt_tokens=150,
        steps=steps,
        ttft=[(101.0, 0.2), (80.0, 9.0)],
        itl=[(101.0, 0.01), (101.5, 0.03)],
        events=[{"time": 101.0, "kind": "evict", "pages": 5}, {"time": 101.2, "kind": "retract"}],
    )
    assert row["window_hit_rate"] == pytest.approx(0.75)
    assert row["output_tokens_per_s"] == pytest.approx(25.0)
    assert row["kv_pages_protected"] == 6 and row["retractions"] == 1
    assert row["steps"] == 3 and row["prefill_tokens"] == 30
    assert row["decode_tokens_per_step"] == pytest.approx(7 / 3)
    assert row["jump_forward_tokens"] == 3 and row["verify_tokens"] == 6
    assert row["step_time_ms"] == pytest.approx(10.0)
    assert row["ttft_p50_s"] == 0.2 and row["itl_p99_s"] == 0.03  # the 80 s one is too old
    assert row["evicted_pages"] == 5 and row["retractions_seen"] == 1
    assert "quantization" not in row
    h.sample(103.0, _stats(), 200, 150)
    h.sample(104.0, _stats(), 200, 150)
    assert [r["seq"] for r in h.since(None)] == [2, 3, 4] and [r["seq"] for r in h.since(3)] == [4]


def test_probe_subscribes_to_engine_events_and_takes_itself_off():
    import gc
    import time

    from plait.radix_cache import PageAllocator, RadixCache
    from plait.runtime.events import EVENT_KINDS, EngineEvents, RequestRetracted, StepFinished
    from plait.runtime.protocol import FinishReason
    from plait.runtime.request import ConstraintState

    events, alloc = EngineEvents(), PageAllocator(8)
    cache = RadixCache(1, alloc)
    events.watch_cache(cache)
    engine = SimpleNamespace(events=events, cache=cache)
    probe = StepProbe(engine)
    probe.install()
    assert probe.installed and events.wants(StepFinished)
    req = SimpleNamespace(
        rid="r",
        output_ids=[],
        prompt_ids=[1, 2],
        constraint=ConstraintState(),
        finished=False,
        first_token_time=time.perf_counter(),
        arrival_time=time.perf_counter() - 0.5,
        num_tokens=2,
        pages=[0],
        cached_tokens=0,
        finish_reason=FinishReason("length", length=2),
    )
    batch = ScheduleBatch(extends=[ExtendEntry(req, 0, 2, True)])
    req.output_ids.append(7)  # the engine appends the step's tokens before the step's event
    events.step_finished(batch, time.perf_counter())
    req.output_ids.append(8)
    events.step_finished(ScheduleBatch(decodes=[req]), time.perf_counter())
    events.emit(RequestRetracted(time.perf_counter(), "r", 2, 1))
    cache.insert([1, 2, 3], alloc.allocate(3))
    cache.match_prefix([1, 2, 3])
    assert cache.evict(3) == [0, 1, 2]
    events.request_finished(req)
    assert [(s.prefill, s.decode) for s in probe.steps] == [(2, 0), (0, 1)]
    assert all(s.seconds is not None and s.batch_size == 1 for s in probe.steps)
    assert len(probe.ttft) == 1 and probe.ttft[0][1] == pytest.approx(0.5, abs=0.1)
    assert len(probe.itl) == 1
    assert [e["kind"] for e in probe.events] == ["retract", "evict"]
    assert probe.events[1]["pages"] == 3 and probe.events[1]["asked"] == 3
    assert list(probe.hits.values()) == [1] and list(probe.finished) == [req]
    probe.uninstall()
    assert not probe.installed and not any(events.wants(k) for k in EVENT_KINDS)
    assert not vars(cache).keys() & {"evict", "match_prefix", "insert"}
    probe.install()
    del probe  # a dashboard that is dropped does not stay subscribed
    gc.collect()
    assert not any(events.wants(k) for k in EVENT_KINDS)


def test_tree_walks_are_reused_within_their_budget():
    from plait.radix_cache import PageAllocator, RadixCache
    from plait.server.dashboard import TREE_BUDGET, DashboardConfig, EngineView

    alloc = PageAllocator(64)
    cache = RadixCache(1, alloc)
    cache.insert([1, 2, 3], alloc.allocate(3))
    engine = SimpleNamespace(core=SimpleNamespace(cache=cache, scheduler=None))
    view = EngineView(engine, DashboardConfig())
    first = view.tree(8, False, now=100.0)
    took = view._tree[2]
    assert view.tree(8, False, now=100.0 + took * TREE_BUDGET / 2) is first
    assert view.tree(4, False, now=100.0) is not first  # other options: walked again
    cache.insert([1, 2, 4], alloc.allocate(3))
    again = view.tree(4, False, now=100.0 + 10 * took * TREE_BUDGET + 1)
    assert again.num_nodes == 3
