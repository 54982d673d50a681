"""What the dashboard sees of each engine step, recorded only while someone watches.

`StepProbe.install()` wraps five methods on the engine's own scheduler and cache instances (not
their classes): `schedule` and `after_step` (the step's composition and time, each request's
first token and token gaps), `retract` and `evict` (events), `match_prefix` (hits per tree node).
`uninstall()` puts the originals back, so a server nobody watches runs the engine's code
untouched. The wrappers run on the engine thread and only append to bounded deques and dicts;
readers on the event loop copy those before using them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

MAX_STEPS = 4096
MAX_EVENTS = 256
MAX_LATENCIES = 4096
MAX_FINISHED = 64
MAX_TRACKED = 8192  # requests whose last token time is remembered (for inter-token latency)


class StepRecord(NamedTuple):
    """One forward pass: tokens by kind, and the wall time from `schedule()` to `after_step()`.
    (A named tuple: one is made per step, and it is the cheapest record to make.)"""

    time: float  # time.time() when it ended
    seconds: float | None  # None when the probe was installed mid-step
    prefill: int  # prompt tokens (and recomputed ones of resumed requests)
    decode: int  # one per decoding request per decode step
    verify: int  # speculative: last token plus the draft, per verified request
    accepted: int  # draft tokens accepted
    jump_forward: int  # tokens a grammar forced, computed as an extend of a running request
    decode_steps: int  # more than one in a burst of back-to-back decode steps
    batch_size: int


class StepProbe:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: deque[StepRecord] = deque(maxlen=MAX_STEPS)
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.ttft: deque[tuple[float, float]] = deque(maxlen=MAX_LATENCIES)  # (time, seconds)
        self.itl: deque[tuple[float, float]] = deque(maxlen=MAX_LATENCIES)
        self.finished: deque[Any] = deque(maxlen=MAX_FINISHED)  # Request objects
        self.hits: dict[int, int] = {}
        self.installed_at: float | None = None  # perf_counter time
        self._patched: list[tuple[Any, str, Any, bool]] = []
        self._step_started: float | None = None
        self._last_token: dict[str, tuple[float, int]] = {}

    @property
    def installed(self) -> bool:
        return bool(self._patched)

    def install(self) -> None:
        if self._patched:
            return
        sched, cache = self.engine.scheduler, self.engine.cache
        self.installed_at = time.perf_counter()
        self._step_started = None
        self._patch(sched, "schedule", self._wrap_schedule)
        self._patch(sched, "after_step", self._wrap_after_step)
        self._patch(sched, "retract", self._wrap_retract)
        self._patch(cache, "evict", self._wrap_evict)
        self._patch(cache, "match_prefix", self._wrap_match_prefix)

    def uninstall(self) -> None:
        while self._patched:
            obj, name, original, had_own = self._patched.pop()
            if had_own:
                setattr(obj, name, original)
            else:
                obj.__dict__.pop(name, None)  # the class's method shows through again
        self._last_token.clear()

    def _patch(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(obj, name, None)
        if original is None:  # an engine without this method: that part of the view stays empty
            return
        had_own = name in vars(obj)
        setattr(obj, name, make(original))
        self._patched.append((obj, name, original, had_own))

    # the wrappers (engine thread) -------------------------------------------------------------

    def _wrap_schedule(self, original: Any) -> Any:
        def schedule(*args: Any, **kwargs: Any) -> Any:
            batch = original(*args, **kwargs)
            self._step_started = time.perf_counter()
            return batch

        return schedule

    def _wrap_after_step(self, original: Any) -> Any:
        def after_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            record = self._composition(batch)
            result = original(batch, *args, **kwargs)
            self._finish_step(batch, record)
            return result

        return after_step

    def _wrap_retract(self, original: Any) -> Any:
        def retract(req: Any, *args: Any, **kwargs: Any) -> Any:
            self.events.append({"time": time.time(), "kind": "retract", "rid": req.rid,
                                "tokens": req.num_tokens, "pages": len(req.pages)})  # fmt: skip
            return original(req, *args, **kwargs)

        return retract

    def _wrap_evict(self, original: Any) -> Any:
        def evict(num_pages: int, *args: Any, **kwargs: Any) -> Any:
            freed = original(num_pages, *args, **kwargs)
            if freed:
                self.events.append({"time": time.time(), "kind": "evict", "pages": len(freed),
                                    "asked": num_pages})  # fmt: skip
            return freed

        return evict

    def _wrap_match_prefix(self, original: Any) -> Any:
        root = self.engine.cache.root

        def match_prefix(tokens: Any, record: bool = True, **kwargs: Any) -> Any:
            result = original(tokens, record, **kwargs)
            if record and result.num_tokens:
                hits, node = self.hits, result.node
                while node is not None and node is not root:
                    hits[node.id] = hits.get(node.id, 0) + 1
                    node = node.parent
            return result

        return match_prefix

    def _composition(self, batch: Any) -> tuple[int, ...]:
        prefill = verify = accepted = jump = 0
        for v in batch.verifies:
            verify += v.end - v.start + len(v.draft_ids)
            accepted += v.num_accepted
        for e in batch.extends:
            req = e.req
            if req.grammar is not None and e.start >= len(req.prompt_ids):
                jump += e.end - e.start
            else:
                prefill += e.end - e.start
        steps = batch.decode_steps
        return (prefill, len(batch.decodes) * steps, verify, accepted, jump, steps,
                len(batch.extends) + len(batch.verifies) + len(batch.decodes))  # fmt: skip

    def _finish_step(self, batch: Any, record: tuple[int, ...]) -> None:
        now = time.perf_counter()
        started, self._step_started = self._step_started, None
        wall = time.time()
        self.steps.append(StepRecord(wall, None if started is None else now - started, *record))
        for req in batch.requests():
            self._track(req, now, wall)

    def _track(self, req: Any, now: float, wall: float) -> None:
        """Time to first token when a request's first token appears; the gap per token after."""
        tracked = self._last_token
        n = len(req.output_ids)
        last = tracked.get(req.rid)
        if last is None:
            first = req.first_token_time
            if first is not None and n and first >= (self.installed_at or 0.0):
                self.ttft.append((wall, first - req.arrival_time))
            if n and len(tracked) < MAX_TRACKED:
                tracked[req.rid] = (now, n)
        elif n > last[1]:
            self.itl.append((wall, (now - last[0]) / (n - last[1])))
            tracked[req.rid] = (now, n)
        if req.finished:
            tracked.pop(req.rid, None)
            self.finished.append(req)

    # readers (event loop) ---------------------------------------------------------------------

    def forget(self, live_rids: set[str], live_node_ids: set[int] | None = None) -> None:
        """Drops what is kept for requests that left without a last step (aborted, expired) and
        hit counts of nodes no longer in the tree."""
        for rid in [r for r in list(self._last_token) if r not in live_rids]:
            self._last_token.pop(rid, None)
        if live_node_ids is not None and len(self.hits) > 2 * len(live_node_ids) + 64:
            for node_id in [n for n in list(self.hits) if n not in live_node_ids]:
                self.hits.pop(node_id, None)
