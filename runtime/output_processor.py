"""Turning sampled tokens into text and deciding when a request stops.

Stop strings are matched on the detokenized text, so a stop string split across tokens is
caught; the text that could still turn into a stop string is held back from streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.runtime.batch import TokenResult
from plait.runtime.detokenizer import IncrementalDetokenizer
from plait.runtime.protocol import FinishReason
from plait.runtime.request import Request, RequestStatus
from plait.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from plait.runtime.constrained.base import Grammar
    from plait.runtime.constrained.jump_forward import Retokenized


@dataclass(frozen=True)
class JumpPlan:
    """A jump-forward the engine would take: the forced text, the retokenizing edit, the output
    tokens kept before it, the output's length after it, and how many kept tokens only rewrite
    the healed text."""

    text: str
    edit: Retokenized
    kept: int
    length: int
    healing: int


# (request, its grammar after a jump, the text jumped over, the room after it) -> a closing that
# fits, or None (`BudgetClosing.after_jump`)
JumpClosing = Callable[[Request, "Grammar", str, int], "list[int] | None"]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, context_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = tokenizer.eos_token_ids
        self.context_len = context_len

    def start(self, req: Request) -> None:
        req.delivery.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=req.sampling.params.skip_special_tokens,
            spaces_between_special_tokens=req.sampling.params.spaces_between_special_tokens,
            prompt_ids=req.prompt_ids,
        )

    def record_input_logprobs(self, req: Request, result: TokenResult) -> None:
        if not req.sampling.logprob.return_logprob:
            return
        if not req.input_token_logprobs:
            first = req.prompt_ids[req.logprob_start]
            req.input_token_logprobs.append((None, first))
            req.input_top_logprobs.append(None)
        req.input_token_logprobs.extend(result.input_logprobs)
        if req.sampling.logprob.top_logprobs_num:
            req.input_top_logprobs.extend(result.input_top)

    def append_tokens(self, req: Request, result: TokenResult) -> int:
        """Adds the step's tokens in order until a stop condition finishes the request; returns
        how many were added."""
        for j, token in enumerate(result.tokens):
            if req.finished:
                return j
            self.append_token(req, token, result, j)
        return len(result.tokens)

    def append_token(self, req: Request, token: int, result: TokenResult, j: int = 0) -> None:
        """Adds one sampled token; finishes the request when a stop condition holds."""
        params = req.sampling.params
        req.output_ids.append(token)
        if req.sampling.logprob.return_logprob:
            req.output_token_logprobs.append((result.logprobs[j], token))
            if req.sampling.logprob.top_logprobs_num:
                req.output_top_logprobs.append(result.tops[j])
        n_out = len(req.output_ids)
        if req.constraint.grammar is not None and not req.constraint.grammar.try_advance(token):
            return self.finish(
                req, FinishReason("abort", message=f"grammar: sampled token {token} is not allowed")
            )
        if n_out >= params.min_new_tokens and req.sampling.stops_at(token, self.eos_ids):
            return self.finish(req, FinishReason("stop", matched=token))
        new_text = req.delivery.detokenizer.add([token])
        if req.healing.tokens == n_out - 1 and len(req.text) + len(new_text) <= len(
            req.healing.text
        ):
            req.healing.tokens += 1  # it only rewrites the healed text: the prompt's, not output
        if new_text:
            req.text += new_text
            if req.healing.free and len(req.text) >= len(req.healing.text):
                req.constraint.grammar = None  # healed: the rest is free
                req.healing.free = False
            if (
                params.stop
                and n_out >= params.min_new_tokens
                and self._match_stop(req, len(new_text))
            ):
                return None
        self._check_length(req)
        if (
            not req.finished
            and req.constraint.grammar is not None
            and req.constraint.grammar.is_terminated()
        ):
            # nothing but EOS may follow: finish as if it was sampled
            self.finish(req, FinishReason("stop", matched=self.tokenizer.eos_token_id))
        return None

    def _check_length(self, req: Request) -> None:
        if req.budget_left <= 0 or req.num_tokens >= self.context_len:
            self.finish(req, FinishReason("length", length=req.num_output_tokens))

    def plan_jump(
        self, req: Request, output_ids: list[int], grammar: Grammar, min_kept_tokens: int
    ) -> JumpPlan | None:
        """The jump over the text `grammar` forces after `output_ids` (`req`'s output, or what it
        would be), if the engine would take it: at least two characters, retokenized to spell
        the same bytes, within the budget and the context, and not replacing tokens whose KV
        pages are shared (`min_kept_tokens`, prompt included)."""
        from plait.runtime.constrained import retokenize

        if req.finished or req.sampling.logprob.return_logprob:
            return None
        text = grammar.try_jump_forward()
        # NOTE: a forced trailing space is left to the model, whose next token carries it
        # (` true`, ` "`, ` 42` after `": `): jumped alone it would be a token of its own
        text = text.rstrip(" ") if text is not None else None
        if text is None or len(text) < 2:
            return None
        edit = retokenize(self.tokenizer, output_ids, text)
        if edit is None:
            return None
        kept = len(output_ids) - edit.num_dropped
        length = kept + len(edit.new_token_ids)
        healing = min(req.healing.tokens, kept)  # kept tokens that only rewrite the healed text
        if (
            length - healing >= req.sampling.params.max_new_tokens
            or len(req.prompt_ids) + length >= self.context_len
            or len(req.prompt_ids) + kept < min_kept_tokens
        ):
            return None
        return JumpPlan(text, edit, kept, length, healing)

    def try_jump_forward(
        self, req: Request, min_kept_tokens: int, closing: JumpClosing | None = None
    ) -> int | None:
        """Appends the text the grammar forces, retokenized at the boundary.

        Returns how many trailing output tokens were replaced (their KV is stale), or None when
        nothing was appended. `min_kept_tokens`: tokens (prompt included) that must not be
        replaced, because their KV pages are shared through the prefix cache. A request steering
        toward its closing jumps only where `closing` finds one that fits after the jump.
        """
        grammar = req.constraint.grammar
        if grammar is None or req.delivery.detokenizer.has_pending:
            return None  # the forced text would start inside a held-back character
        plan = self.plan_jump(req, req.output_ids, grammar, min_kept_tokens)
        if plan is None:
            return None
        text, edit, kept, new_len, healing = (
            plan.text,
            plan.edit,
            plan.kept,
            plan.length,
            plan.healing,
        )
        path = None
        if req.closing.path is not None:
            probe = grammar.copy()
            if closing is None or not probe.replace_tail(edit.num_dropped, edit.new_token_ids):
                return None
            room = min(
                req.sampling.params.max_new_tokens - new_len + healing,
                self.context_len - 1 - len(req.prompt_ids) - new_len,
            )
            path = closing(req, probe, text, room)
            if path is None:
                return None
        if not grammar.replace_tail(edit.num_dropped, edit.new_token_ids):
            return None
        if path is not None:
            req.closing.path = path
        req.healing.tokens = healing
        del req.output_ids[kept:]
        req.output_ids.extend(edit.new_token_ids)
        req.constraint.jump_forward_tokens += len(edit.new_token_ids)
        req.spec.index = None  # the n-gram index saw the replaced tokens
        req.spec.draft_valid = min(req.spec.draft_valid, len(req.prompt_ids) + kept)
        req.text += text
        req.delivery.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=req.sampling.params.skip_special_tokens,
            spaces_between_special_tokens=req.sampling.params.spaces_between_special_tokens,
            prompt_ids=req.all_ids,
        )
        if req.sampling.params.stop and self._match_stop(req, len(text)):
            return edit.num_dropped
        self._check_length(req)
        if not req.finished and grammar.is_terminated():
            self.finish(req, FinishReason("stop", matched=self.tokenizer.eos_token_id))
        return edit.num_dropped

    def _match_stop(self, req: Request, num_new_chars: int) -> bool:
        longest = max(len(s) for s in req.sampling.params.stop)
        # NOTE: the healed text is the prompt's: a stop string matches only what follows it
        window_start = max(len(req.text) - num_new_chars - longest + 1, len(req.healing.text))
        best: tuple[int, str] | None = None
        for s in req.sampling.params.stop:
            i = req.text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        index, matched = best
        if not req.sampling.params.no_stop_trim:
            req.text = req.text[:index]
        else:
            req.text = req.text[: index + len(matched)]
        self.finish(req, FinishReason("stop", matched=matched), flush=False)
        return True

    def finish(self, req: Request, reason: FinishReason, flush: bool = True) -> None:
        if flush and req.delivery.detokenizer is not None and reason.type != "abort":
            req.text += req.delivery.detokenizer.flush()
        if req.closing.closed_early and reason.type == "stop" and reason.matched in self.eos_ids:
            # steered to its end by its budget (`budget_closing.py`): the budget ended it
            reason = FinishReason("length", length=req.num_output_tokens)
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED
        req.finish_time = time.perf_counter()

    def stream_text(self, req: Request) -> str:
        """The text a stream may show now: everything, except a tail that may begin a stop
        string."""
        if req.finished or not req.sampling.params.stop:
            return req.text
        hold = max(len(s) for s in req.sampling.params.stop) - 1
        return req.text[: max(len(req.text) - hold, 0)]
