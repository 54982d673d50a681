"""Whether speculation pays at the current batch size, decided by measurement.

A request's own acceptance (the gate in `base.Drafter`) says whether its drafts are any good; it
cannot say what verifying them costs. At batch 1 a decode step is memory-bound, and verifying
four extra tokens per request is nearly free; at batch 8 the same drafts make the matmuls five
times taller and the step far slower, so a draft acceptance that wins at batch 1 can lose there.

Per batch-size bucket (1, 2-3, 4-7, 8-15, 16-31, 32+) the tokens per second of decode steps that
verified drafts and of those that did not are compared by `runtime/governor.Governor`:
speculation is measured first. On the CPU the plain steps are bursts of continuous decode steps,
the rival drafts must beat: whole bursts while the governor does not speculate, and short ones
(`engine.SPECULATIVE_BURST_STEPS`) where it does but the drafter found nothing; both count as
plain. Counting steps by the governor's choice would mix those short bursts into the drafts'
rate: on an extractive workload, a preamble without drafts would make speculation look slower
than bursts, and it would not be tried again while the text was being copied.
"""

from __future__ import annotations

from plait.runtime.governor import EXPLORE_EVERY, EXPLORE_STEPS, Governor

__all__ = ["EXPLORE_EVERY", "EXPLORE_STEPS", "SpeculationGovernor"]


class SpeculationGovernor(Governor):
    """`Governor`, with re-measuring paced by decode steps rather than by engine steps (a burst of
    continuous decode steps is one engine step: paced per engine step, a burst mode that had won
    would try drafts again only every ~1,500 decode steps)."""

    def __init__(self) -> None:
        super().__init__()
        self._steps: dict[int, int] = {}  # decode steps recorded in the bucket
        self._since: dict[int, int] = {}  # ... since it last re-measured
        self._exploring: dict[int, int] = {}  # choices left to make the other way

    def _explore(self, k: int) -> bool:
        left = self._exploring.get(k, 0)
        if left:
            self._exploring[k] = left - 1
        return left > 0

    def speculate(self, batch_size: int) -> bool:
        """Whether this step's decodes should draft."""
        k, b = self.bucket(batch_size), self.rates(batch_size)
        if (
            b.first is None
        ):  # no draft verified yet: look for one, for a while, then while re-measuring
            return self._steps.get(k, 0) < EXPLORE_EVERY or self._explore(k)
        if b.second is None:
            return False
        better = b.first >= b.second
        return not better if self._explore(k) else better

    def record(
        self, batch_size: int, verified: bool, tokens: float, seconds: float, steps: int = 1
    ) -> None:
        """A pure decode step (no prefill chunk) of `steps` decode steps that delivered `tokens` in
        `seconds`, `verified` drafts or not."""
        super().record(batch_size, verified, tokens, seconds)
        k = self.bucket(batch_size)
        self._steps[k] = self._steps.get(k, 0) + steps
        self._since[k] = self._since.get(k, 0) + steps
        if self._since[k] >= EXPLORE_EVERY:
            self._since[k] = 0
            self._exploring[k] = EXPLORE_STEPS
