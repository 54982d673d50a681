"""Decode bursts: many decode steps run back to back in one native call
(`BurstRunner.run`), the engine loop's way to decode on the CPU without Python between
steps. `Bursts` decides how long each one may run (the step planner reserves its pages,
`step_planner.py`); the runner runs it (`ModelRunner.execute`); `burst_streams.py` hands a
streaming request its tokens while one runs; `constrained/burst_masks.py` fills grammar masks
between its steps.

How long: only while nothing waits to be scheduled, and no longer than ~`BURST_SECONDS` (by the
last decode step's time), so that a new request waits at most that long for its prefill. With
speculative decoding, a batch the drafter found nothing for runs `SPECULATIVE_BURST_STEPS` at most
while the policy speculates (so that a draft is looked for again soon), and whole bursts while it
does not: the speculation governor weighs drafts against bursts, not against single steps. A
constrained request near its budget caps the burst where budget-aware closing looks next.
"""

from __future__ import annotations

from plait.runtime.batch import ScheduleBatch
from plait.runtime.budget_closing import BudgetClosing
from plait.runtime.tuning import BURST_SECONDS, SPECULATIVE_BURST_STEPS


class Bursts:
    """`max_steps`: the configured cap (`num_continuous_decode_steps`; 1 turns bursts off)."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.decode_step_s: float | None = None  # the last decode-only step's forward time

    def steps(
        self,
        batch: ScheduleBatch,
        *,
        can_burst: bool,
        idle: bool,
        speculating: bool,
        closing: BudgetClosing,
    ) -> int:
        """Decode steps `batch` may run in one call, before its pages are reserved; 1 is a plain
        step. `can_burst`: the runner can run the batch as a burst; `idle`: no message waits in
        the engine's inbox."""
        limit = min(self.max_steps, SPECULATIVE_BURST_STEPS) if speculating else self.max_steps
        if (
            limit <= 1
            or self.decode_step_s is None
            or not idle
            or batch.others_waiting
            or not can_burst
        ):
            return 1
        limit = min(limit, max(1, int(BURST_SECONDS / max(self.decode_step_s, 1e-6))))
        for req in batch.decodes:  # a constrained request near its budget: where it steers
            before = closing.steps_before(req)
            limit = limit if before is None else min(limit, before)
        return limit

    def record(self, batch: ScheduleBatch, step_s: float) -> None:
        """A step's forward time per decode step, which sizes the next bursts."""
        if not batch.queried:
            self.decode_step_s = step_s
