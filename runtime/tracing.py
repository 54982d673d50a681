"""A timeline of what the engine did, as a Chrome trace: `EngineTrace` subscribes to the engine's
events (`Engine.events`, `runtime/events.py`) and keeps them as Trace Event Format records, which
Perfetto (ui.perfetto.dev) and chrome://tracing open.

- thread "steps": one slice per engine step, from its scheduling to the end of its bookkeeping,
  with its prefill, decode, verification and jump-forward tokens, decode steps and batch size;
- thread "requests": one async slice per request, from its submission to its final result, with
  its prompt, cached and output tokens and how it ended;
- thread "cache": an instant for each eviction and each retraction (pages taken back).

Times are microseconds since the trace began. The trace keeps at most `max_events` records and
counts the ones it had to drop (`dropped`), so a long-running server cannot grow it without bound.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from plait.runtime.events import (
    CacheEvicted,
    EngineEvents,
    RequestFinished,
    RequestRetracted,
    RequestSubmitted,
    StepFinished,
    Subscription,
)

TRACE_KINDS = (RequestSubmitted, StepFinished, RequestFinished, RequestRetracted, CacheEvicted)
THREADS = {"steps": 1, "requests": 2, "cache": 3}  # Trace Event Format thread ids


class EngineTrace:
    """Records `events` from construction until `close()` (or the end of a `with` block)."""

    def __init__(self, events: EngineEvents, max_events: int = 1_000_000) -> None:
        if max_events < 1:
            raise ValueError(f"max_events: must be at least 1, got {max_events}")
        self.max_events = max_events
        self.dropped = 0
        self.start = time.perf_counter()
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # submissions arrive on callers' threads
        self._subscription: Subscription | None = events.subscribe(self._on_event, TRACE_KINDS)

    def __enter__(self) -> EngineTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops recording; what was recorded stays readable."""
        if self._subscription is not None:
            self._subscription.unsubscribe()
            self._subscription = None

    @property
    def num_events(self) -> int:
        return len(self._records)

    def to_json(self) -> dict[str, Any]:
        """The trace as Trace Event Format's JSON object."""
        with self._lock:
            records = list(self._records)
        names = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
            for name, tid in THREADS.items()
        ]
        process = {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "plait engine"}}
        return {
            "traceEvents": [process, *names, *records],
            "displayTimeUnit": "ms",
            "otherData": {"dropped_events": self.dropped},
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Writes the trace to `path` (JSON, whole, replacing the file); returns the path."""
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json()), encoding="utf-8")
        tmp.replace(target)
        return target

    # recording -----------------------------------------------------------------------------

    def _us(self, t: float) -> float:
        return round((t - self.start) * 1e6, 3)

    def _add(self, record: dict[str, Any]) -> None:
        with self._lock:
            if len(self._records) >= self.max_events:
                self.dropped += 1
                return
            self._records.append(record)

    def _on_event(self, event: Any) -> None:
        if isinstance(event, StepFinished):
            self._add(
                {
                    "name": "step",
                    "ph": "X",
                    "pid": 1,
                    "tid": THREADS["steps"],
                    "ts": self._us(event.time - event.seconds),
                    "dur": round(event.seconds * 1e6, 3),
                    "args": {
                        "batch_size": event.batch_size,
                        "prefill_tokens": event.prefill_tokens,
                        "decode_tokens": event.decode_tokens,
                        "verify_tokens": event.verify_tokens,
                        "accepted_tokens": event.accepted_tokens,
                        "jump_forward_tokens": event.jump_forward_tokens,
                        "decode_steps": event.decode_steps,
                    },
                }
            )
        elif isinstance(event, RequestSubmitted):
            self._request(event.time, "b", event.rid, {"prompt_tokens": event.prompt_tokens})
        elif isinstance(event, RequestFinished):
            args = {
                "finish_reason": event.reason.type,
                "prompt_tokens": event.prompt_tokens,
                "cached_tokens": event.cached_tokens,
                "output_tokens": event.output_tokens,
            }
            self._request(event.time, "e", event.rid, args)
        elif isinstance(event, RequestRetracted):
            args = {"rid": event.rid, "tokens": event.tokens, "pages": event.pages}
            self._instant(event.time, "retract", args)
        elif isinstance(event, CacheEvicted):
            self._instant(event.time, "evict", {"pages": event.pages, "asked": event.asked})

    def _request(self, t: float, phase: str, rid: str, args: dict[str, Any]) -> None:
        self._add(
            {
                "name": "request",
                "cat": "request",
                "ph": phase,
                "id": rid,
                "pid": 1,
                "tid": THREADS["requests"],
                "ts": self._us(t),
                "args": args,
            }
        )

    def _instant(self, t: float, name: str, args: dict[str, Any]) -> None:
        self._add(
            {
                "name": name,
                "ph": "i",
                "s": "t",
                "pid": 1,
                "tid": THREADS["cache"],
                "ts": self._us(t),
                "args": args,
            }
        )
