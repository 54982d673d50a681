"""What the dashboard sees of each engine step, recorded only while someone watches.

`StepProbe.install()` subscribes to the engine's events (`Engine.events`, `runtime/events.py`):
`StepFinished` (the step's composition and time, each request's first token and token gaps),
`RequestFinished`, `RequestRetracted` and `CacheEvicted` (events), `CacheMatched` (hits per tree
node). `uninstall()` unsubscribes, so a server nobody watches has no subscriber on the engine's
step. The callbacks run on the engine thread and only append to bounded deques and dicts;
readers on the event loop copy those before using them.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from plait.runtime.events import (
    CacheEvicted,
    CacheMatched,
    RequestFinished,
    RequestRetracted,
    StepFinished,
)

MAX_STEPS = 4096
MAX_EVENTS = 256
MAX_LATENCIES = 4096
MAX_FINISHED = 64
MAX_TRACKED = 8192  # requests whose last token time is remembered (for inter-token latency)


class StepRecord(NamedTuple):
    """One forward pass: tokens by kind, and the wall time from its scheduling to the end of its
    bookkeeping. (A named tuple: one is made per step, and it is the cheapest record to make.)"""

    time: float  # time.time() when it ended
    seconds: float | None
    prefill: int  # prompt tokens (and recomputed ones of resumed requests)
    decode: int  # one per decoding request per decode step
    verify: int  # speculative: last token plus the draft, per verified request
    accepted: int  # draft tokens accepted
    jump_forward: int  # tokens a grammar forced, computed as an extend of a running request
    decode_steps: int  # more than one in a burst of back-to-back decode steps
    batch_size: int


def subscribe_weakly(
    engine: Any, method: Callable[[Any], None], kinds: tuple[type, ...]
) -> weakref.finalize | None:
    """Subscribes a bound method without the engine keeping its object alive: the engine's loop
    holds the hub, and a dashboard that is dropped must not stay subscribed (nor keep the engine
    it holds from being collected). Calling the returned finalizer unsubscribes (once); it runs by
    itself when the object is collected. None for an engine without events."""
    events = getattr(engine, "events", None)
    if events is None:
        return None
    ref = weakref.WeakMethod(method)

    def call(event: Any) -> None:
        target = ref()
        if target is not None:
            target(event)

    sub = events.subscribe(call, kinds)
    return weakref.finalize(method.__self__, sub.unsubscribe)


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
        self._subscription: weakref.finalize | None = None
        self._last_token: dict[str, tuple[float, int]] = {}
        self._handlers: dict[type, Callable[[Any], None]] = {
            StepFinished: self._step_finished,
            RequestFinished: self._request_finished,
            RequestRetracted: self._retracted,
            CacheEvicted: self._evicted,
            CacheMatched: self._matched,
        }

    @property
    def installed(self) -> bool:
        return self._subscription is not None

    def install(self) -> None:
        if self._subscription is not None:
            return
        self.installed_at = time.perf_counter()
        self._subscription = subscribe_weakly(self.engine, self._on_event, tuple(self._handlers))

    def uninstall(self) -> None:
        if self._subscription is not None:
            self._subscription()
            self._subscription = None
        self._last_token.clear()

    # the subscriber (engine thread) -----------------------------------------------------------

    def _on_event(self, event: Any) -> None:
        self._handlers[type(event)](event)

    def _step_finished(self, step: StepFinished) -> None:
        now = time.perf_counter()
        wall = time.time()
        self.steps.append(
            StepRecord(
                wall,
                step.seconds,
                step.prefill_tokens,
                step.decode_tokens,
                step.verify_tokens,
                step.accepted_tokens,
                step.jump_forward_tokens,
                step.decode_steps,
                step.batch_size,
            )
        )
        for req in step.requests:
            self._track(req, now, wall)

    def _request_finished(self, event: RequestFinished) -> None:
        self._last_token.pop(event.rid, None)
        self.finished.append(event.request)

    def _retracted(self, event: RequestRetracted) -> None:
        self.events.append(
            {
                "time": time.time(),
                "kind": "retract",
                "rid": event.rid,
                "tokens": event.tokens,
                "pages": event.pages,
            }
        )

    def _evicted(self, event: CacheEvicted) -> None:
        self.events.append(
            {"time": time.time(), "kind": "evict", "pages": event.pages, "asked": event.asked}
        )

    def _matched(self, event: CacheMatched) -> None:
        if event.matched_tokens:
            hits = self.hits
            for node_id in event.node_ids:
                hits[node_id] = hits.get(node_id, 0) + 1

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

    # readers (event loop) ---------------------------------------------------------------------

    def forget(self, live_rids: set[str], live_node_ids: set[int] | None = None) -> None:
        """Drops what is kept for requests no longer live (each entry also goes when its request
        finishes) and hit counts of nodes no longer in the tree."""
        for rid in [r for r in list(self._last_token) if r not in live_rids]:
            self._last_token.pop(rid, None)
        if live_node_ids is not None and len(self.hits) > 2 * len(live_node_ids) + 64:
            for node_id in [n for n in list(self.hits) if n not in live_node_ids]:
                self.hits.pop(node_id, None)
