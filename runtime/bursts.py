"""Decode bursts: many decode steps run back to back in one native call
(`ModelRunner.decode_burst`), the engine loop's way to decode on the CPU without Python between
steps. `Bursts` decides how long each one runs and runs it; `burst_streams.py` hands a streaming
request its tokens while one runs; `constrained/burst_masks.py` fills grammar masks between its
steps.

How long: only while nothing waits to be scheduled, and no longer than ~`BURST_SECONDS` (by the
last decode step's time), so that a new request waits at most that long for its prefill. With
speculative decoding, a batch the drafter found nothing for runs `SPECULATIVE_BURST_STEPS` at most
while the policy speculates (so that a draft is looked for again soon), and whole bursts while it
does not: the speculation governor weighs drafts against bursts, not against single steps. A
constrained request near its budget caps the burst where budget-aware closing looks next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.runtime.batch import ScheduleBatch, TokenResult
from plait.runtime.budget_closing import BudgetClosing
from plait.runtime.burst_streams import BurstStreams, StreamedTokens
from plait.runtime.output_processor import OutputProcessor
from plait.runtime.request import Request
from plait.runtime.tuning import BURST_SECONDS, SPECULATIVE_BURST_STEPS


class Bursts:
    """`max_steps`: the configured cap (`num_continuous_decode_steps`; 1 turns bursts off).
    `interrupt`: the ctypes int32 that `EngineCore.post` sets, ending a running burst after its
    current step."""

    def __init__(
        self,
        max_steps: int,
        processor: OutputProcessor,
        deliver: Callable[[Request], None],
        interrupt: Any,
    ) -> None:
        self.max_steps = max_steps
        self._processor = processor
        self._deliver = deliver
        self._interrupt = interrupt
        self.decode_step_s: float | None = None  # the last decode-only step's forward time
        self.burst_step_s: float | None = None  # the same within the last burst

    def steps(
        self, batch: ScheduleBatch, runner: Any, scheduler: Any, *,
        idle: bool, speculating: bool, closing: BudgetClosing,
    ) -> int:  # fmt: skip
        """Decode steps to run for `batch` in one call; 1 is a plain step. `idle`: no message
        waits in the engine's inbox."""
        limit = min(self.max_steps, SPECULATIVE_BURST_STEPS) if speculating else self.max_steps
        if (
            limit <= 1 or self.decode_step_s is None or not idle
            or scheduler.waiting or scheduler.prefilling or scheduler.suspects
            or not runner.can_burst(batch)
        ):  # fmt: skip
            return 1
        limit = min(limit, max(1, int(BURST_SECONDS / max(self.decode_step_s, 1e-6))))
        for req in batch.decodes:  # a constrained request near its budget: where it steers
            before = closing.steps_before(req)
            limit = limit if before is None else min(limit, before)
        return scheduler.grow_for_burst(batch.decodes, limit) if limit > 1 else 1

    def run(
        self, batch: ScheduleBatch, runner: Any, steps: int
    ) -> tuple[list[TokenResult], dict[int, StreamedTokens]]:
        """`runner.decode_burst`; the tokens of streaming requests are handed on between its
        steps, each as soon as it is picked. Returns the results and, by id(request), what was
        handed on already."""
        rows = [(i, r) for i, r in enumerate(batch.decodes) if r.streaming]
        if not rows:
            return runner.decode_burst(batch, steps, self._interrupt), {}
        out = torch.full((len(batch.decodes), steps), -1, dtype=torch.long)  # [B, steps]
        streams = BurstStreams(rows, out.numpy(), self._processor, self._deliver)
        results = runner.decode_burst(
            batch, steps, self._interrupt, out=out, between_steps=streams.before_step
        )
        return results, streams.streamed

    def record(self, batch: ScheduleBatch, step_s: float) -> None:
        """A step's forward time per decode step, which sizes the next bursts."""
        if not batch.queried:
            self.decode_step_s = step_s
            if batch.decode_steps > 1:
                self.burst_step_s = step_s
