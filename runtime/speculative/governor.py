"""Whether speculation pays at the current batch size, decided by measurement.

A request's own acceptance (the gate in `base.Drafter`) says whether its drafts are any good; it
cannot say what verifying them costs. At batch 1 a decode step is memory-bound, and verifying
four extra tokens per request is nearly free; at batch 8 the same drafts make the matmuls five
times taller and the step far slower, so a draft acceptance that wins at batch 1 loses there
(measured: n-gram drafts on open-ended chat, 0.96x at batch 1 and 0.84x at batch 8).

The governor keeps, per batch-size bucket (1, 2-3, 4-7, 8-15, 16-31, 32+), a moving average of
the tokens per second that decode steps delivered with drafts and without, measures both once,
then runs the faster mode, re-measuring the other for `EXPLORE_STEPS` of every `EXPLORE_EVERY`
steps so that a change of workload is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass

EMA = 0.8
EXPLORE_EVERY = 96
EXPLORE_STEPS = 2


@dataclass
class _Bucket:
    spec: float | None = None  # tokens/s of decode steps with drafts
    plain: float | None = None  # ... and without
    steps: int = 0


class SpeculationGovernor:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return min(max(batch_size, 1).bit_length(), 6)

    def speculate(self, batch_size: int) -> bool:
        """Whether this step's decodes should draft."""
        b = self._buckets.setdefault(self.bucket(batch_size), _Bucket())
        b.steps += 1
        if b.spec is None:
            return True
        if b.plain is None:
            return False
        better = b.spec >= b.plain
        exploring = b.steps % EXPLORE_EVERY < EXPLORE_STEPS
        return not better if exploring else better

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A pure decode step (no prefill chunk): `tokens` delivered in `seconds`."""
        if seconds <= 0:
            return
        b = self._buckets.setdefault(self.bucket(batch_size), _Bucket())
        rate = tokens / seconds
        if speculated:
            b.spec = rate if b.spec is None else EMA * b.spec + (1 - EMA) * rate
        else:
            b.plain = rate if b.plain is None else EMA * b.plain + (1 - EMA) * rate

    def snapshot(self) -> dict[int, tuple[float | None, float | None]]:
        return {k: (b.spec, b.plain) for k, b in sorted(self._buckets.items())}
