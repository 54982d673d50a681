"""What the engine tells observers: typed events from the one place each thing happens, and the
`EngineEvents` hub they subscribe to (`Engine.events`).

Each event, when it is emitted, and on whose thread:

- `RequestSubmitted`: when `Engine` hands a request to its loop (`generate`, `async_generate`,
  streams, the KV handoff); on the caller's thread.
- `BatchScheduled`: after the scheduler picked a step's batch (drafts included), before its
  forward pass; on the engine's thread.
- `StepFinished`: after a step's bookkeeping (tokens appended, pages released), before its results
  are delivered; on the engine's thread.
- `RequestFinished`: when a request's final result is delivered, however it ended; on the
  engine's thread.
- `RequestRetracted`: when the scheduler takes a running request's pages back to requeue it; on
  the engine's thread.
- `CacheMatched`, `CacheInserted`, `CacheEvicted`: when the radix cache looks a prompt up (not a
  look-ahead), takes new pages, frees pages; on the engine's thread.

Subscribers are called synchronously, in the order they subscribed: they must be quick (append to
a bounded container, bump a counter) and thread-safe towards whoever reads what they keep. An
event's `request` is the engine's own record: read it during the call, never change it. A
subscriber that raises is counted (`Subscription.errors`, `EngineEvents.num_errors`) and logged
once; the engine carries on. With nobody subscribed to a kind, emitting it costs one dictionary
lookup: the emitter checks `wants(kind)` before it builds the event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.radix_cache import MatchResult, RadixCache
    from plait.runtime.batch import ScheduleBatch
    from plait.runtime.protocol import FinishReason
    from plait.runtime.request import Request

logger = logging.getLogger("plait.engine")


@dataclass(frozen=True, slots=True)
class RequestSubmitted:
    time: float  # time.perf_counter(), the clock of the request's own times
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    request: Request


@dataclass(frozen=True, slots=True)
class BatchScheduled:
    time: float
    extend_tokens: int  # prompt chunks, recomputed tokens of resumed requests, forced text
    num_extends: int
    num_verifies: int  # decodes that verify a speculative draft
    num_decodes: int
    requests: tuple[Request, ...]  # extends, then verifies, then decodes


@dataclass(frozen=True, slots=True)
class StepFinished:
    time: float
    seconds: float  # from the batch's scheduling to the end of its bookkeeping
    prefill_tokens: int  # prompt tokens (and recomputed ones of resumed requests)
    decode_tokens: int  # one per decoding request per decode step
    verify_tokens: int  # speculative: last token plus the draft, per verified request
    accepted_tokens: int  # draft tokens accepted
    jump_forward_tokens: int  # tokens a grammar forced, computed as an extend of a running request
    decode_steps: int  # more than one in a burst of back-to-back decode steps
    requests: tuple[Request, ...]  # as in `BatchScheduled`, with this step's tokens appended

    @property
    def batch_size(self) -> int:
        return len(self.requests)


@dataclass(frozen=True, slots=True)
class RequestFinished:
    time: float
    rid: str
    reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    request: Request


@dataclass(frozen=True, slots=True)
class RequestRetracted:
    time: float
    rid: str
    tokens: int  # its prompt and output so far, recomputed when it resumes
    pages: int  # pages it held


@dataclass(frozen=True, slots=True)
class CacheMatched:
    time: float
    queried_tokens: int
    matched_tokens: int
    node_ids: tuple[int, ...]  # the matched path's tree nodes, deepest first (the root left out)


@dataclass(frozen=True, slots=True)
class CacheInserted:
    time: float
    tokens: int  # whole-page tokens of the inserted sequence
    cached_tokens: int  # of those, tokens the tree held already
    pages: int  # pages the tree took


@dataclass(frozen=True, slots=True)
class CacheEvicted:
    time: float
    pages: int  # pages freed
    asked: int  # pages the caller needed


EVENT_KINDS: tuple[type, ...] = (
    RequestSubmitted,
    BatchScheduled,
    StepFinished,
    RequestFinished,
    RequestRetracted,
    CacheMatched,
    CacheInserted,
    CacheEvicted,
)


class Subscription:
    """The handle `subscribe` returns: `unsubscribe()` (idempotent), or use it as a context
    manager."""

    def __init__(self, hub: EngineEvents, callback: Callable[[Any], None], kinds: tuple[type, ...]):
        self.hub = hub
        self.callback = callback
        self.kinds = kinds
        self.errors = 0

    @property
    def active(self) -> bool:
        return self.hub.holds(self)

    def unsubscribe(self) -> None:
        self.hub.remove(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unsubscribe()


class EngineEvents:
    """The engine's event hub. Subscribing and unsubscribing take a lock and may happen on any
    thread; emitting reads one dictionary, replaced whole on each change, without a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_kind: dict[type, tuple[Subscription, ...]] = {}
        self.num_errors = 0

    def subscribe(
        self, callback: Callable[[Any], None], kinds: type | Iterable[type] | None = None
    ) -> Subscription:
        """Calls `callback(event)` for each event of `kinds` (an event class or several; all of
        `EVENT_KINDS` by default) until the returned handle unsubscribes."""
        if kinds is None:
            wanted = EVENT_KINDS
        else:
            wanted = (kinds,) if isinstance(kinds, type) else tuple(kinds)
        for kind in wanted:
            if kind not in EVENT_KINDS:
                names = ", ".join(k.__name__ for k in EVENT_KINDS)
                raise ValueError(f"kinds: {kind!r} is not an engine event (one of {names})")
        sub = Subscription(self, callback, wanted)
        with self._lock:
            by_kind = dict(self._by_kind)
            for kind in wanted:
                by_kind[kind] = (*by_kind.get(kind, ()), sub)
            self._by_kind = by_kind
        return sub

    def remove(self, sub: Subscription) -> None:
        with self._lock:
            by_kind = {}
            for kind, subs in self._by_kind.items():
                left = tuple(s for s in subs if s is not sub)
                if left:
                    by_kind[kind] = left
            self._by_kind = by_kind

    def holds(self, sub: Subscription) -> bool:
        return any(sub in subs for subs in self._by_kind.values())

    def wants(self, kind: type) -> bool:
        """Whether anyone listens for `kind`: emitters check it before they build an event."""
        return kind in self._by_kind

    def emit(self, event: Any) -> None:
        for sub in self._by_kind.get(type(event), ()):
            try:
                sub.callback(event)
            except Exception:
                sub.errors += 1
                self.num_errors += 1
                if sub.errors == 1:
                    logger.exception(
                        "event subscriber %r failed on %s (later failures are only counted)",
                        sub.callback,
                        type(event).__name__,
                    )

    # the emitters that need more than a constructor ------------------------------------------

    def batch_scheduled(self, batch: ScheduleBatch) -> None:
        self.emit(
            BatchScheduled(
                time.perf_counter(),
                sum(e.end - e.start for e in batch.extends),
                len(batch.extends),
                len(batch.verifies),
                len(batch.decodes),
                tuple(batch.requests()),
            )
        )

    def step_finished(self, batch: ScheduleBatch, started: float, decode_steps: int = 1) -> None:
        prefill = verify = accepted = jump = 0
        for v in batch.verifies:
            verify += v.end - v.start + len(v.draft_ids)
            accepted += v.num_accepted
        for e in batch.extends:
            if e.req.constraint.grammar is not None and e.start >= len(e.req.prompt_ids):
                jump += e.end - e.start
            else:
                prefill += e.end - e.start
        now = time.perf_counter()
        steps = decode_steps
        self.emit(
            StepFinished(
                now,
                now - started,
                prefill,
                len(batch.decodes) * steps,
                verify,
                accepted,
                jump,
                steps,
                tuple(batch.requests()),
            )
        )

    def request_finished(self, req: Request) -> None:
        assert req.finish_reason is not None
        self.emit(
            RequestFinished(
                time.perf_counter(),
                req.rid,
                req.finish_reason,
                len(req.prompt_ids),
                req.cached_tokens,
                len(req.output_ids),
                req,
            )
        )

    def watch_cache(self, cache: RadixCache) -> None:
        """Points the radix cache's hooks at this hub (the cache imports nothing of the runtime)."""

        def matched(result: MatchResult, queried: int) -> None:
            if CacheMatched in self._by_kind:
                ids = []
                node = result.node
                while node is not None and node.parent is not None:  # up to the root, left out
                    ids.append(node.id)
                    node = node.parent
                self.emit(CacheMatched(time.perf_counter(), queried, result.num_tokens, tuple(ids)))

        def inserted(tokens: int, cached: int, pages: int) -> None:
            if CacheInserted in self._by_kind:
                self.emit(CacheInserted(time.perf_counter(), tokens, cached, pages))

        def evicted(freed: list[int], asked: int) -> None:
            if CacheEvicted in self._by_kind:
                self.emit(CacheEvicted(time.perf_counter(), len(freed), asked))

        cache.on_match, cache.on_insert, cache.on_evict = matched, inserted, evicted
