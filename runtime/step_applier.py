"""The last stage of an engine step: everything that happens to requests once the runner is done.

`StepApplier.apply` takes the plan and the runner's results, each carrying its request, and
appends each request's tokens (a verification's accepted drafts; a streamed burst's tokens that
were handed on already are skipped), steering a request near its budget toward its closing
(`BudgetClosing.steer`), and ends a prompt that has no token to take. The engine then hands the
step to the scheduler's bookkeeping (`Scheduler.after_step`: computed KV recorded, prompts cached,
finished requests' pages released), and `StepApplier.settle` lets each constrained request jump
over the text its grammar forces or start closing, a retokenized tail rewound through the KV cache
manager (`KVCacheManager.rewind`, recomputed from the next `schedule`), and delivers.

Every request ends through `end` (finish, then deliver) or, inside a step, through the output
processor's finish and the step's delivery; `deliver` is the one way out to a request's sink.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

import numpy as np

from plait.runtime.batch import RequestResult, StepResults, TokenResult
from plait.runtime.budget_closing import BudgetClosing
from plait.runtime.burst_streams import BurstStreams
from plait.runtime.closing_jobs import ClosingJobs
from plait.runtime.events import EngineEvents, RequestFinished, StepFinished
from plait.runtime.kv_cache_manager import KVCacheManager
from plait.runtime.output_processor import JumpPlan, OutputProcessor
from plait.runtime.outputs import build_output
from plait.runtime.protocol import FinishReason
from plait.runtime.request import Request
from plait.runtime.speculation import Speculation
from plait.runtime.step_planner import StepPlan
from plait.runtime.tokenizer import Tokenizer

logger = logging.getLogger("plait.engine")


class StepApplier:
    """`totals`: the engine's counters (`generated_tokens`, `steps`, `burst_steps`), updated here;
    `events`: where a finished step and each finished request are announced (`Engine.events`).
    `closing` is set once built, since it plans jumps through this object (`plan_jump`)."""

    def __init__(
        self,
        *,
        processor: OutputProcessor,
        tokenizer: Tokenizer,
        kv: KVCacheManager,
        speculation: Speculation,
        page_size: int,
        jump_forward: bool,
        totals: dict[str, int],
        events: EngineEvents | None = None,
    ) -> None:
        self.processor = processor
        self.tokenizer = tokenizer
        self.kv = kv
        self.speculation = speculation
        self.page_size = page_size
        self.jump_forward = jump_forward
        self.totals = totals
        self.events = events if events is not None else EngineEvents()
        self.closing: BudgetClosing = None  # type: ignore[assignment]

    # the step -----------------------------------------------------------------------------------

    def apply(self, plan: StepPlan, output: StepResults) -> list[RequestResult]:
        """Appends the step's tokens; the results with news for their requests (`settle`)."""
        self.totals["steps"] += output.decode_steps
        if plan.burst:
            self.totals["burst_steps"] += output.decode_steps
        return [r for r in output.results if self._take(r)]

    def settle(self, plan: StepPlan, output: StepResults, updated: list[RequestResult]) -> None:
        """Once the scheduler has recorded the step: jumps forward and closings of the requests
        that moved, then their delivery."""
        for r in updated:
            if r.prompt_done:
                self._close_or_jump(r.req)
        if self.events.wants(StepFinished):
            self.events.step_finished(plan.batch, plan.started, output.decode_steps)
        for r in updated:
            self.deliver(r.req)

    def _take(self, r: RequestResult) -> bool:
        """Appends one request's tokens; whether it has news to deliver."""
        req, result, got = r.req, r.tokens, r.streamed
        if got is not None and got.taken:  # its first `taken` tokens are appended already
            self.totals["generated_tokens"] += got.added
            if req.finished or len(result.tokens) == got.taken:
                return req.finished  # by the streamer: delivered with the step's final results
            result = TokenResult(tokens=result.tokens[got.taken :])
        if req.finished:
            return False
        self.processor.record_input_logprobs(req, result)
        if result.tokens:
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            if req.closing.path is not None:
                # an extend caches the request's whole pages after the step (`after_step`)
                result = self.closing.steer(req, result, prefilled=r.extend is not None)
            added = self.processor.append_tokens(req, result)
            self.totals["generated_tokens"] += added
            if r.verify is not None:
                r.verify.num_accepted = min(len(result.tokens) - 1, added)
                self.speculation.observe(req, len(r.verify.draft_ids), len(result.tokens) - 1)
            return True
        if r.prompt_done:  # a prompt with no token to take (`max_new_tokens: 0`)
            self.processor.finish(req, FinishReason("length", length=req.num_output_tokens))
            return True
        return False

    def _close_or_jump(self, req: Request) -> None:
        """After a step: a constrained request near its budget steers toward its closing
        (`BudgetClosing.check`); others jump over the text their grammar forces."""
        if req.constraint.grammar is None or req.finished:
            return
        self.closing.check(req)
        # NOTE: not over the healed text alone: that would re-append the very token healing
        # backed up over, instead of letting the model choose the merged one; nor while a closing
        # is looked for off the loop: the search is of this state, and the request waits for it
        if self.jump_forward and not _healing(req) and req.closing.job is None:
            self._jump_forward(req)

    def _jump_forward(self, req: Request) -> None:
        before = req.num_tokens
        replaced = self.processor.try_jump_forward(
            req,
            min_kept_tokens=req.kv.num_cached_pages * self.page_size,
            closing=self.closing.after_jump,
        )
        if replaced is not None:
            self.kv.rewind(req, num_valid=before - replaced)

    def plan_jump(
        self, req: Request, output_ids: list[int], grammar: Any, prefilled: bool
    ) -> JumpPlan | None:
        """The jump over forced text after `output_ids` that `_close_or_jump` would take after
        this step (`prefilled`: the step extends `req`, so its whole pages will be cached)."""
        if not self.jump_forward or _healing(req):
            return None
        cached = req.kv.num_cached_pages * self.page_size
        if prefilled:
            cached = max(cached, req.num_tokens // self.page_size * self.page_size)
        return self.processor.plan_jump(req, output_ids, grammar, cached)

    def take_closings(self, running: list[Request]) -> None:
        """Before a step: requests whose off-loop closing search is done go back to decoding,
        steering where their room is down to the closing found."""
        held = [r for r in running if r.closing.job is not None]
        for req in ClosingJobs.done(held) if held else ():
            self.closing.job_done(req)

    def burst_streams(self, rows: list[tuple[int, Request]], out: np.ndarray) -> BurstStreams:
        """The streams of a burst's streaming rows (`ModelRunner.execute`)."""
        return BurstStreams(rows, out, self.processor, self.deliver)

    # ending and delivering ----------------------------------------------------------------------

    def end(self, req: Request, reason: FinishReason) -> None:
        """Finishes `req` with `reason` and delivers it, unless it finished already (then its
        final result went out with it)."""
        if req.finished:
            return
        self.processor.finish(req, reason)
        self.deliver(req)

    def deliver(self, req: Request) -> None:
        if req.finished and self.events.wants(RequestFinished):
            self.events.request_finished(req)
        if req.delivery.sink is None:
            return
        out = build_output(req, self.tokenizer, self.processor.stream_text(req))
        try:
            req.delivery.sink(out, req.finished)
        except Exception:
            logger.error("delivering request %s failed: %s", req.rid, traceback.format_exc())


def _healing(req: Request) -> bool:
    """Whether the output has yet to cover the text token healing backed up over, and what the
    grammar forces does not reach past it (then the jump retokenizes across the boundary, which
    is what healing is for)."""
    if not req.healing.text or len(req.text) >= len(req.healing.text):
        return False
    grammar = req.constraint.grammar
    forced = grammar.try_jump_forward() if grammar is not None else None
    return forced is None or len(req.text) + len(forced) <= len(req.healing.text)
