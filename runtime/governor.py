"""Choosing between two ways to run a step, per batch-size bucket, by measuring both.

`Governor` keeps, per bucket of a step's size (by bit length: 1, 2-3, 4-7, …), a moving average
of the work per second each way delivered. It measures the first way, then the second, then runs
the faster, re-measuring the other for `EXPLORE_STEPS` of every `EXPLORE_EVERY` steps so that a
change (of workload, of load on the machine) is noticed. The speculation governor
(`speculative/governor.py`) and the thread governor below are its two uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.runtime.tuning import EXPLORE_EVERY, EXPLORE_STEPS
from plait.runtime.tuning import GOVERNOR_EMA as EMA


@dataclass
class _Bucket:
    first: float | None = None  # work/s of steps run the first way
    second: float | None = None  # ... and the second
    steps: int = 0
    warm: int = 0  # the bucket's first steps, run the first way and not counted


class Governor:
    """`warmup`: a bucket's first steps (run the first way) that only warm up, not measured: the
    first steps of a size pay one-time costs (buffers, pages) that would count against the way
    measured first."""

    def __init__(self, max_bucket: int = 6, warmup: int = 0) -> None:
        self.max_bucket = max_bucket
        self.warmup = warmup
        self._buckets: dict[int, _Bucket] = {}

    def bucket(self, size: int) -> int:
        return min(max(size, 1).bit_length(), self.max_bucket)

    def rates(self, size: int) -> _Bucket:
        """The bucket of steps of `size`: the work/s measured each way so far."""
        return self._buckets.setdefault(self.bucket(size), _Bucket())

    def choose_first(self, size: int) -> bool:
        """Whether this step should run the first way."""
        b = self.rates(size)
        b.steps += 1
        if b.first is None:
            return True
        if b.second is None:
            return False
        better = b.first >= b.second
        exploring = b.steps % EXPLORE_EVERY < EXPLORE_STEPS
        return not better if exploring else better

    def record(self, size: int, first: bool, work: float, seconds: float) -> None:
        """A step of `size` run the `first` way did `work` in `seconds`."""
        if seconds <= 0:
            return
        b = self._buckets.setdefault(self.bucket(size), _Bucket())
        if b.warm < self.warmup:
            b.warm += 1
            return
        rate = work / seconds
        if first:
            b.first = rate if b.first is None else EMA * b.first + (1 - EMA) * rate
        else:
            b.second = rate if b.second is None else EMA * b.second + (1 - EMA) * rate

    def snapshot(self) -> dict[int, tuple[float | None, float | None]]:
        return {k: (b.first, b.second) for k, b in sorted(self._buckets.items())}


class ThreadGovernor:
    """All CPU threads, or one, for small steps: whichever computed more tokens per second.

    On an idle machine two threads win (a decode step reads its weights twice as fast). When
    other processes take cores, the OpenMP team of a parallel region waits at each barrier for a
    thread the OS has descheduled; a decode step runs hundreds of such regions, so on a busy
    machine one thread can finish a step several times sooner than all of them.
    Steps of `MAX_TOKENS` tokens or more (prefill chunks: few barriers per unit of work) always use
    every thread.
    """

    MAX_TOKENS = 64

    def __init__(self, threads: int) -> None:
        self.threads = threads
        # one warm-up step a bucket: the first decode steps after a prefill run slower on two
        # threads than the steady state, and a single such sample would settle the governor on one
        self._gov = Governor(max_bucket=self.MAX_TOKENS.bit_length(), warmup=1)

    def choose(self, num_tokens: int) -> int:
        if num_tokens >= self.MAX_TOKENS or self._gov.choose_first(num_tokens):
            return self.threads
        return 1

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        if num_tokens < self.MAX_TOKENS:
            self._gov.record(num_tokens, threads == self.threads, num_tokens, seconds)

    def snapshot(self) -> dict[int, tuple[float | None, float | None]]:
        """Per bucket: tokens/s with every thread, with one."""
        return self._gov.snapshot()
