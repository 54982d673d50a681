"""`Engine.events` on a real tiny engine: a request's events in order, the radix cache's match,
insert and evict events, a raising subscriber that does not disturb generation, unsubscribing,
and the example of docs/observability.md."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import pytest

from plait.runtime.events import (
    EVENT_KINDS,
    BatchScheduled,
    CacheEvicted,
    CacheInserted,
    CacheMatched,
    RequestFinished,
    RequestSubmitted,
    StepFinished,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
GREEDY = {"max_new_tokens": 4, "temperature": 0}


class Recorder:
    def __init__(self) -> None:
        self.events: list = []
        self.threads: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def __call__(self, event) -> None:
        with self._lock:
            self.events.append(event)
            self.threads.setdefault(type(event).__name__, set()).add(
                threading.current_thread().name
            )

    def of(self, rid: str) -> list[str]:
        """The kinds of the events that concern request `rid`, in order."""
        out = []
        for e in self.events:
            if getattr(e, "rid", None) == rid or any(
                r.rid == rid for r in getattr(e, "requests", ())
            ):
                out.append(type(e).__name__)
        return out


@pytest.fixture(scope="module")
def events_engine(tiny_llama_dir):
    """An engine of this module's own: the shared `tiny_engine` may carry subscribers that
    other tests' servers left (their dashboards), which these tests count."""
    from plait import Engine

    engine = Engine(
        model_path=str(tiny_llama_dir), max_total_tokens=4096, page_size=4, check_invariants=True
    )
    yield engine
    engine.shutdown()


def _collapse(kinds: list[str]) -> list[str]:
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def test_a_requests_events_come_in_order(events_engine):
    rec = Recorder()
    with events_engine.events.subscribe(rec) as sub:
        out = events_engine.generate("Events, in the order they happen:", GREEDY, rid="ev-order")
    assert not sub.active and sub.errors == 0
    kinds = rec.of("ev-order")
    assert kinds[0] == "RequestSubmitted" and kinds[-1] == "RequestFinished"
    steps = kinds[1:-1]
    assert steps and steps[0] == "BatchScheduled"
    assert set(_collapse(steps)) == {"BatchScheduled", "StepFinished"}
    assert all(a != b for a, b in zip(steps, steps[1:]))  # scheduled, stepped, scheduled, ...
    assert kinds.count("StepFinished") >= 2  # the prefill, then decodes (or a burst of them)
    submitted = next(e for e in rec.events if isinstance(e, RequestSubmitted))
    finished = next(e for e in rec.events if isinstance(e, RequestFinished))
    meta = out["meta_info"]
    assert (submitted.rid, submitted.prompt_tokens, submitted.max_new_tokens) == (
        "ev-order",
        meta["prompt_tokens"],
        4,
    )
    assert finished.reason.type == meta["finish_reason"]["type"] == "length"
    assert finished.output_tokens == meta["completion_tokens"] == 4
    assert finished.time >= submitted.time
    mine = [e for e in rec.events if isinstance(e, StepFinished)]
    computed = sum(e.prefill_tokens + e.decode_tokens for e in mine)
    assert computed == meta["prompt_tokens"] - meta["cached_tokens"] + 3  # the last token: no KV
    assert all(e.seconds >= 0 and e.batch_size == len(e.requests) for e in mine)
    scheduled = [e for e in rec.events if isinstance(e, BatchScheduled)]
    assert scheduled[0].extend_tokens == meta["prompt_tokens"] - meta["cached_tokens"]
    assert rec.threads["RequestSubmitted"] == {threading.current_thread().name}
    assert rec.threads["StepFinished"] == rec.threads["RequestFinished"] == {"plait-engine"}


def test_kinds_filter_and_unsubscribe(events_engine):
    rec = Recorder()
    sub = events_engine.events.subscribe(rec, kinds=RequestFinished)
    assert events_engine.events.wants(RequestFinished) and not events_engine.events.wants(
        StepFinished
    )
    events_engine.generate("Only the finish, please.", GREEDY)
    assert [type(e) for e in rec.events] == [RequestFinished]
    sub.unsubscribe()
    sub.unsubscribe()  # idempotent
    assert not any(events_engine.events.wants(k) for k in EVENT_KINDS)
    events_engine.generate("Nobody listens now.", GREEDY)
    assert len(rec.events) == 1
    with pytest.raises(ValueError, match="kinds: .* is not an engine event"):
        events_engine.events.subscribe(rec, kinds=int)


def test_a_raising_subscriber_does_not_break_generation(events_engine, caplog):
    expected = events_engine.generate("The subscriber fails, the engine does not.", GREEDY)

    def broken(event):
        raise RuntimeError("subscriber bug")

    errors_before = events_engine.events.num_errors
    rec = Recorder()
    with caplog.at_level(logging.ERROR, logger="plait.engine"):
        with events_engine.events.subscribe(broken) as bad, events_engine.events.subscribe(rec):
            outs = [
                events_engine.generate("The subscriber fails, the engine does not.", GREEDY)
                for _ in range(2)
            ]
    assert [o["text"] for o in outs] == [expected["text"]] * 2
    assert bad.errors > 2 and events_engine.events.num_errors - errors_before == bad.errors
    assert sum("event subscriber" in r.getMessage() for r in caplog.records) == 1
    # the subscriber after the broken one still saw everything
    assert [type(e) for e in rec.events].count(RequestFinished) == 2


def test_cache_events(tiny_llama_dir):
    from plait import Engine

    # 64 pages of 4 tokens: the third long prompt needs pages the first two left in the cache
    engine = Engine(
        model_path=str(tiny_llama_dir), max_total_tokens=256, page_size=4, check_invariants=True
    )
    try:
        rec = Recorder()
        prompts = [f"Prompt {i}: " + " ".join(f"w{i}x{j}" for j in range(30)) for i in range(3)]
        with engine.events.subscribe(rec, kinds=(CacheMatched, CacheInserted, CacheEvicted)):
            first = engine.generate(prompts[0], {"max_new_tokens": 2, "temperature": 0})
            again = engine.generate(prompts[0], {"max_new_tokens": 2, "temperature": 0})
            for p in prompts[1:]:
                engine.generate(p, {"max_new_tokens": 2, "temperature": 0})
        inserted = [e for e in rec.events if isinstance(e, CacheInserted)]
        matched = [e for e in rec.events if isinstance(e, CacheMatched)]
        evicted = [e for e in rec.events if isinstance(e, CacheEvicted)]
        assert inserted and inserted[0].cached_tokens == 0
        assert (
            inserted[0].pages * 4
            == inserted[0].tokens
            >= first["meta_info"]["prompt_tokens"] // 4 * 4
        )
        assert again["meta_info"]["cached_tokens"] > 0
        hit = [m for m in matched if m.matched_tokens]
        assert hit and hit[0].matched_tokens == again["meta_info"]["cached_tokens"]
        assert hit[0].node_ids and all(isinstance(i, int) for i in hit[0].node_ids)
        assert evicted and all(e.pages >= 1 and e.asked >= 1 for e in evicted)
        stats = engine.stats()
        assert stats["kv_pages_cached"] == sum(e.pages for e in inserted) - sum(
            e.pages for e in evicted
        )
    finally:
        engine.shutdown()


def test_the_observability_doc_example_runs(events_engine):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert blocks
    for block in blocks:
        exec(
            compile(block, str(DOC), "exec"),
            {"__name__": "observability_doc", "engine": events_engine},
        )
