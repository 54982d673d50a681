"""Whether speculation pays at the current batch size, decided by measurement.

A request's own acceptance (the gate in `base.Drafter`) says whether its drafts are any good; it
cannot say what verifying them costs. At batch 1 a decode step is memory-bound, and verifying
four extra tokens per request is nearly free; at batch 8 the same drafts make the matmuls five
times taller and the step far slower, so a draft acceptance that wins at batch 1 loses there
(measured: n-gram drafts on open-ended chat, 0.96x at batch 1 and 0.84x at batch 8).

Per batch-size bucket (1, 2-3, 4-7, 8-15, 16-31, 32+) the tokens per second of decode steps with
drafting and without are compared by `runtime/governor.Governor`: speculation is measured first.
A step counts as speculating when the governor chose it, whether or not the drafter found
anything: speculating steps verify what was found and run short bursts where nothing was
(`engine.SPECULATIVE_BURST_STEPS`); the others run whole bursts of continuous decode steps, the
rival drafts must beat. (Counted by drafts found instead, a drafter that never finds anything
would never be measured, and its requests would keep to short bursts.)
"""

from __future__ import annotations

from plait.runtime.governor import EXPLORE_EVERY, EXPLORE_STEPS, Governor

__all__ = ["EXPLORE_EVERY", "EXPLORE_STEPS", "SpeculationGovernor"]


class SpeculationGovernor(Governor):
    def speculate(self, batch_size: int) -> bool:
        """Whether this step's decodes should draft."""
        return self.choose_first(batch_size)

    def record(self, batch_size: int, speculated: bool, tokens: float, seconds: float) -> None:
        """A pure decode step (no prefill chunk): `tokens` delivered in `seconds`."""
        super().record(batch_size, speculated, tokens, seconds)
