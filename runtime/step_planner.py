"""The second stage of an engine step: every per-step choice, made in one place.

The scheduler hands over a batch (`Scheduler.schedule`); `StepPlanner.plan` decides how to run
it and returns a `StepPlan`, which the runner executes as it is (`ModelRunner.execute`):

- drafts to verify: where the speculation policy drafts this step, the drafter proposes, and each
  decode whose pages can grow over its draft becomes a `VerifyEntry` (`runtime/speculation.py`);
- the CPU threads (`ThreadPolicy`);
- one step or a burst of decode steps (multi-step decode), and the pages that burst needs, which
  are reserved here (`runtime/bursts.py`);
- how the forward runs its layers: all in one native call or one by one (`Execution.layers_for`).

Pages for drafts and bursts come straight from the KV cache manager; the scheduler is not asked
again. After the step, `record` feeds the step's time back to the policies that measure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from plait.runtime.batch import ScheduleBatch, StepResults, VerifyEntry
from plait.runtime.budget_closing import BudgetClosing
from plait.runtime.bursts import Bursts
from plait.runtime.execution import Execution, Layers
from plait.runtime.kv_cache_manager import KVCacheManager
from plait.runtime.policies import ThreadPolicy
from plait.runtime.request import Request
from plait.runtime.speculation import Speculation


@dataclass
class StepPlan:
    """How one step runs: `batch` (its decodes with drafts turned into verifications), its layers,
    `decode_steps` decode steps in one call (a burst when more than one; every decode's pages
    cover them), on `threads` CPU threads (None: a fixed count, nothing to learn)."""

    batch: ScheduleBatch
    layers: Layers
    num_tokens: int  # tokens whose KV one of its decode steps computes; the threads chose for it
    decode_steps: int = 1
    threads: int | None = None
    speculating: bool = False  # the policy drafted this step (whether or not a draft was found)
    started: float = 0.0  # perf_counter() when planning began: drafting counts in the step's time

    @property
    def burst(self) -> bool:
        return self.decode_steps > 1


class StepPlanner:
    """`can_burst(batch)`: whether the runner can run the batch as a burst
    (`BurstRunner.can_run`)."""

    def __init__(
        self,
        *,
        kv: KVCacheManager,
        execution: Execution,
        can_burst: Callable[[ScheduleBatch], bool],
        speculation: Speculation,
        threads: ThreadPolicy,
        bursts: Bursts,
        closing: BudgetClosing,
        context_len: int,
        tiers: Any = None,
    ) -> None:
        self.kv = kv
        self.execution = execution
        self.can_burst = can_burst
        self.speculation = speculation
        self.threads = threads
        self.bursts = bursts
        self.closing = closing
        self.context_len = context_len
        self.tiers = tiers  # KVTiers, which learn the prefill rate

    def plan(self, batch: ScheduleBatch, *, idle: bool) -> StepPlan:
        """`idle`: no message waits in the engine's inbox (a burst would not hold one up)."""
        started = time.perf_counter()
        speculating = self.speculation.speculate(batch)
        if speculating:
            drafts = self.speculation.propose(batch.decodes, self.context_len)
            batch = self._verify_drafts(batch, drafts)
        num_tokens = batch.num_tokens
        threads = self.threads.choose(num_tokens)
        steps = self.bursts.steps(
            batch,
            can_burst=self.can_burst(batch),
            idle=idle,
            speculating=speculating,
            closing=self.closing,
        )
        if steps > 1:
            steps = self._reserve_burst(batch.decodes, steps)
        layers = self._layers(batch)
        return StepPlan(batch, layers, num_tokens, steps, threads, speculating, started)

    def _verify_drafts(
        self, batch: ScheduleBatch, drafts: dict[Request, list[int]]
    ) -> ScheduleBatch:
        """The batch with its decodes turned into verifications (last token + draft) where
        pages allow."""
        keep, verifies = [], list(batch.verifies)
        for req in batch.decodes:
            draft = drafts.get(req)
            if draft and self.kv.grow(req, req.num_tokens + len(draft)):
                n = req.num_tokens
                verifies.append(VerifyEntry(req, n - 1, n, draft))
            else:
                keep.append(req)
        return replace(batch, verifies=verifies, decodes=keep)

    def _reserve_burst(self, reqs: list[Request], limit: int) -> int:
        """How many decode steps `reqs` take in one burst: at most `limit`, no more than any of
        them may still produce, and 1 unless each gets pages for all of them (what the others got
        is trimmed after the step, `Scheduler.after_step`)."""
        steps = min(limit, *(r.tokens_left(self.context_len) for r in reqs))
        if steps <= 1:
            return 1
        for req in reqs:
            if not self.kv.grow(req, req.num_tokens + steps - 1):
                return 1
        return steps

    def _layers(self, batch: ScheduleBatch) -> Layers:
        """From the forward's rows: each entry's new tokens and draft, one per decode."""
        q_lens = [e.end - e.start for e in batch.extends]
        q_lens += [v.end - v.start + len(v.draft_ids) for v in batch.verifies]
        return self.execution.layers_for(sum(q_lens) + len(batch.decodes), max(q_lens, default=0))

    def record(self, plan: StepPlan, results: StepResults) -> None:
        """What the step took, for the policies that measure: burst length, threads, whether to
        draft, the tiers' prefill rate."""
        batch, step_s = plan.batch, results.step_s
        if self.tiers is not None and batch.extends:
            self.tiers.record_prefill(sum(e.end - e.start for e in batch.extends), step_s)
        self.bursts.record(batch, step_s)
        self.threads.record(plan.num_tokens, plan.threads, step_s)
        if self.speculation.drafter is not None and not batch.extends and results.results:
            # verifying drafts against bursts: a step the drafter found nothing for counts as a
            # plain one (a short burst), whoever chose it
            self.speculation.policy.record(
                len(results.results),
                bool(batch.verifies),
                sum(len(r.tokens.tokens) for r in results.results),
                time.perf_counter() - plan.started,
                steps=results.decode_steps,
            )
