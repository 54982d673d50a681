"""Streams fed from inside a decode burst.

A burst (`ModelRunner.decode_burst`) runs many decode steps in one native call, which writes each
step's tokens into its output buffer as it goes. Left alone, a streaming request in it would get
its tokens in one clump when the call returns. While the call runs, the `BurstStreamer` thread
reads the buffer and hands each token on as soon as it is written: appended through the output
processor (text, stop strings, length) and delivered to the request's sink.

NOTE: the engine thread is inside the native call meanwhile, so the streamer is the only Python
code that touches those requests; `finish`, once the call has returned, waits until it has let
go and says how many of each request's tokens it took. A request the streamer finished (a stop
token or string, its length) is not delivered here: the engine thread delivers it after the
step's pages are released, as it does every final result.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from plait.runtime.batch import TokenResult
from plait.runtime.output_processor import OutputProcessor
from plait.runtime.request import Request
from plait.runtime.tuning import STREAM_POLL_FRACTION, STREAM_POLL_MIN_SECONDS

logger = logging.getLogger("plait.engine")


@dataclass
class StreamedTokens:
    """What the streamer did for one request during a burst."""

    taken: int = 0  # tokens of the request's row it read (the engine thread skips them)
    added: int = 0  # of those, tokens the output processor appended before the request finished


@dataclass
class _Burst:
    rows: list[tuple[int, Request]]  # (row of the buffer, its streaming request)
    out: np.ndarray  # [B, steps] int64, -1 where no token is written yet
    step_s: float  # the expected time of one decode step
    stop_all: bool  # every row streams: once all finished, the burst may end
    started: float = field(default_factory=time.perf_counter)
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while tokens are handed on
    streamed: dict[int, StreamedTokens] = field(default_factory=dict)  # by id(request)


class BurstStreamer:
    """One thread (`plait-streams`), started with the first streaming burst; `close` ends it."""

    def __init__(
        self, processor: OutputProcessor, deliver: Callable[[Request], None], interrupt: Any
    ) -> None:
        self._processor = processor
        self._deliver = deliver
        self._interrupt = interrupt  # the burst's ctypes int32: set, the burst ends after a step
        self._cond = threading.Condition()
        self._burst: _Burst | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self, rows: list[tuple[int, Request]], out: torch.Tensor, step_s: float) -> None:
        """Watches `out` ([B, steps] int64, filled with -1) for the tokens of `rows`' requests
        until `finish`; `step_s` paces the looks."""
        burst = _Burst(rows, out.numpy(), max(step_s, 0.0), stop_all=len(rows) == out.shape[0])
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="plait-streams", daemon=True)
                self._thread.start()
            self._burst = burst
            self._cond.notify()

    def finish(self) -> dict[int, StreamedTokens]:
        """After the burst's call returned: stops watching it; the tokens not taken by then are
        the caller's to append."""
        with self._cond:
            burst, self._burst = self._burst, None
        if burst is None:
            return {}
        burst.done = True
        with burst.lock:  # the streamer is between two looks now, and sees `done` at the next
            return burst.streamed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._burst = None
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        last: _Burst | None = None
        while True:
            with self._cond:
                while (self._burst is None or self._burst is last) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                burst = last = self._burst
            try:
                self._watch(burst)
            except Exception:  # the engine thread hands on what is left when the call returns
                logger.exception("streaming a burst's tokens failed")

    def _watch(self, burst: _Burst) -> None:
        step_s = burst.step_s
        poll = max(step_s * STREAM_POLL_FRACTION, STREAM_POLL_MIN_SECONDS)
        seen = 0  # steps whose tokens were handed on
        # when step `anchored` ended, as best known: the burst's start, then a step found by
        # polling (within a poll of its end). NOTE: a step found on the first look may have ended
        # long before (the look came late), so it does not move the schedule.
        anchor, anchored, empty = burst.started, 0, 0
        while not burst.done:
            due = anchor + (seen + 1 - anchored) * step_s
            time.sleep(max(due - time.perf_counter(), poll))
            with burst.lock:
                if burst.done:
                    return
                now_seen = self._take(burst)
            if now_seen > seen:
                if empty:
                    anchor, anchored = time.perf_counter() - poll / 2, now_seen
                seen, empty = now_seen, 0
            else:
                empty += 1

    def _take(self, burst: _Burst) -> int:
        """Hands on every token written since the last look; returns the steps seen so far."""
        seen, finished = 0, 0
        out, steps = burst.out, burst.out.shape[1]
        for row, req in burst.rows:
            got = burst.streamed.setdefault(id(req), StreamedTokens())
            col = got.taken
            while col < steps and out[row, col] >= 0:
                col += 1
            seen = max(seen, col)
            if req.finished:
                finished += 1
                continue
            if col == got.taken:
                continue
            tokens = out[row, got.taken : col].tolist()
            # NOTE: counted as taken once appended: if appending raises, the engine thread appends
            # them again after the call, and the failure goes through its own recovery
            got.added += self._processor.append_tokens(req, TokenResult(tokens=tokens))
            got.taken = col
            if req.finished:
                finished += 1
            else:
                self._deliver(req)
        if burst.stop_all and finished == len(burst.rows) and not burst.done:
            self._interrupt.value = 1  # nobody waits for the rest of this burst
        return seen
