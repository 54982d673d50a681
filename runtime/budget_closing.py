"""Budget-aware closing: a constrained request about to run out of room (`max_new_tokens`, the
context) is steered so that what it returns parses, and steered only as much as the room needs.

Far from its budget a request samples freely. Once its room is within reach of the closing its
grammar needs (the tokens to an accepting state, found by `ClosingSearch`) plus what one step may
add, it *steers*: it keeps a closing that fits its room (`ClosingState.path`), and a sampled
token stands only if a closing still fits after it (the known one without its first token, the
known one, or, where the room is short, a fresh search). Otherwise the model's next-best allowed
token that fits stands in for it, and failing those the closing's next token. An output the model
finishes within its budget therefore comes back as the model wrote it; one that would not fit
keeps the model's own tokens for as long as a closing fits after them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from plait.runtime.batch import TokenResult
from plait.runtime.request import Request
from plait.runtime.tuning import (
    CLOSING_GROWTH_PER_TOKEN,
    CLOSING_INLINE_MAX_TOKENS,
    CLOSING_MAX_MISSES,
    CLOSING_MIN_EXPECTED,
    CLOSING_STEP_SECONDS,
)

if TYPE_CHECKING:
    from plait.runtime.closing_jobs import ClosingJobs
    from plait.runtime.constrained.base import Grammar
    from plait.runtime.constrained.closing import ClosingSearch
    from plait.runtime.output_processor import JumpPlan
    from plait.runtime.tokenizer import Tokenizer


# (request, its output or what it would be, its grammar there, whether this step extends the
# request) -> the jump the engine would take after the step, or None
PlanJump = Callable[[Request, list[int], "Grammar", bool], "JumpPlan | None"]


class BudgetClosing:
    """The closing decisions of one engine: when a request starts and stops steering, and which
    token a steering request takes."""

    def __init__(
        self,
        search: Callable[[], ClosingSearch],
        jobs: ClosingJobs,
        tokenizer: Tokenizer,
        context_len: int,
        slack: int,
        plan_jump: PlanJump,
    ) -> None:
        """`search`: the tokenizer's `ClosingSearch`; `slack`: tokens one step may add to a
        request, plus a margin for what they may open (`CLOSING_GROWTH`); `plan_jump`: the
        jump-forward the engine would take after some output (None: none)."""
        self._search = search
        self.plan_jump = plan_jump
        self.tokenizer = tokenizer
        self.token_bytes = tokenizer.vocab_bytes()
        self.jobs = jobs
        self.context_len = context_len
        self.eos_token_id = tokenizer.eos_token_id
        self.slack = slack

    def room(self, req: Request) -> int:
        """Tokens `req` may still add: its `max_new_tokens` and the context, whichever is less."""
        return min(req.budget_left, self.context_len - 1 - req.num_tokens)

    def start(self, req: Request, shortest: list[int] | None) -> None:
        """At submit: `shortest` is the closing the submit probe found from the grammar's start
        (None: none found); a budget that close to it steers from the first token."""
        if shortest is None:
            return
        req.closing.tokens = len(shortest)
        if self.room(req) - len(shortest) <= self.slack:
            req.closing.path = list(shortest)

    # before a step's tokens are appended ------------------------------------------------------

    def steer(self, req: Request, result: TokenResult, prefilled: bool = False) -> TokenResult:
        """The step's token for a steering request: the sampled one if a closing fits after it,
        else the first of the model's alternatives that leaves one, else the closing's next
        token. Only the sampled token gets a fresh search (within `CLOSING_STEP_SECONDS`, and
        only where the room is at most `CLOSING_INLINE_MAX_TOKENS`); the alternatives are
        checked against the known closing."""
        path = req.closing.path
        if path is None or req.constraint.grammar is None or not result.tokens:
            return result
        sampled = result.tokens[0]
        room = self.room(req) - 1  # after this token
        deadline = (
            time.perf_counter() + CLOSING_STEP_SECONDS
            if room <= CLOSING_INLINE_MAX_TOKENS
            else None
        )
        chosen: tuple[int, list[int]] | None = None
        for token in [sampled, *(t for t in result.alternatives if t != sampled)]:
            limit = deadline if token == sampled else None
            rest = self._fits(req, token, path, room, limit, prefilled)
            if rest is not None:
                chosen = (token, rest)
                break
        if chosen is None and not req.constraint.grammar.accepts_after(path):
            # NOTE: the known closing no longer leads to an end (a jump it counted on was not
            # taken): the sampled token stands, and the closing is looked for again
            req.closing.path = None
            self._found(req, None, room)
            return result
        if chosen is None:  # the closing goes on; an empty one ends here
            chosen = (path[0], path[1:]) if path else (self.eos_token_id, [])
        token, req.closing.path = chosen
        if token == sampled:
            return result
        req.closing.closed_early = True
        logprobs = result.logprobs
        if logprobs:
            known = dict(zip(result.alternatives, result.alternative_logprobs))
            logprobs = [known.get(token), *logprobs[1:]]  # type: ignore[list-item]
        return TokenResult(
            tokens=[token],
            logprobs=logprobs,
            tops=result.tops,
            input_logprobs=result.input_logprobs,
            input_top=result.input_top,
        )

    def after_jump(self, req: Request, probe: Grammar, forced: str, room: int) -> list[int] | None:
        """For a steering request about to jump over `forced` (`probe`: its grammar after the
        jump): a closing of at most `room` tokens from there, or None (then it does not jump).
        The known closing spells `forced` first; what follows it is tried before a search."""
        rest = self._after_text(req.closing.path or [], forced.encode("utf-8"))
        if rest is not None and len(rest) <= room and probe.accepts_after(rest):
            return rest
        deadline = time.perf_counter() + CLOSING_STEP_SECONDS
        return self._search_within(
            probe, room, deadline if room <= CLOSING_INLINE_MAX_TOKENS else None
        )

    def _fits(
        self,
        req: Request,
        token: int,
        path: list[int],
        room: int,
        deadline: float | None,
        prefilled: bool,
    ) -> list[int] | None:
        """A closing of at most `room` tokens after `token`, or None: the known `path` without
        its first token, the whole of it, the forced rest of the output where jump-forward
        will write it in fewer tokens, or (with a `deadline`) a search."""
        grammar = req.constraint.grammar
        if room < 0:
            return None
        if path and token == path[0]:
            return path[1:]
        if path and len(path) - 1 <= room and grammar.accepts_after([token, *path[1:]]):
            return path[1:]
        if grammar.accepts_after([token, *path]):
            if len(path) <= room:
                return list(path)
            # NOTE: the closing after `token` is the known one: no search finds one much
            # shorter (the known one is short from the state before `token`)
            deadline = None
        probe = grammar.copy()
        if not probe.try_advance(token):
            return None
        ending = self._forced_ending(req, token, probe, path, deadline, prefilled)
        if ending is not None:
            return ending
        return self._search_within(probe, room, deadline)

    def _forced_ending(
        self,
        req: Request,
        token: int,
        probe: Grammar,
        path: list[int],
        deadline: float | None,
        prefilled: bool,
    ) -> list[int] | None:
        """Where the engine will jump over forced text after `token` (retokenized, the output
        may come out in fewer tokens than were sampled, as it would with closing off) and a
        closing fits the room after the jump: the forced text as tokens, then that closing."""
        plan = self.plan_jump(req, [*req.output_ids, token], probe, prefilled)
        if plan is None:
            return None
        jumped = probe.copy()
        if not jumped.replace_tail(plan.edit.num_dropped, plan.edit.new_token_ids):
            return None
        room = min(
            req.sampling.params.max_new_tokens - (plan.length - plan.healing),
            self.context_len - 1 - len(req.prompt_ids) - plan.length,
        )
        spelled = self.token_bytes[token] + plan.text.encode("utf-8")
        rest = self._after_text(path, spelled)
        if rest is None or len(rest) > room or not jumped.accepts_after(rest):
            rest = self._search_within(jumped, room, deadline)
        if rest is None:
            return None
        forward = [*self.tokenizer.encode(plan.text, add_special_tokens=False), *rest]
        return forward if probe.accepts_after(forward) else None

    def _after_text(self, path: list[int], text: bytes) -> list[int] | None:
        """What follows `text` in `path` where `path` spells it first, token for token; else
        None."""
        spelled = b""
        for k, token in enumerate(path):
            if spelled == text:
                return path[k:]
            spelled += self.token_bytes[token]
            if not text.startswith(spelled):
                return None
        return [] if spelled == text else None

    def _search_within(self, probe: Grammar, room: int, deadline: float | None) -> list[int] | None:
        """A fresh search for a closing of at most `room` tokens, while `deadline` allows."""
        left = 0.0 if deadline is None else deadline - time.perf_counter()
        if room < 0 or left <= 0:
            return None
        return self._search().shortest_completion(probe, room, time_limit=left)

    # after a step -----------------------------------------------------------------------------

    def check(self, req: Request) -> None:
        """After a step: a request whose room is down to its closing (as last measured, plus
        what it may have grown by since, plus `slack`) looks for it and steers from here; a
        steering request whose closing shrank well below its room samples freely again.

        The closing is looked for again only once the room is within what it may have grown to
        since it was last found (`CLOSING_GROWTH_PER_TOKEN` per token), so a request takes a few
        searches, each bounded in time. One expected to be long, or one a quick search missed,
        is looked for off the loop (`jobs`); `job_done` takes it from there."""
        grammar = req.constraint.grammar
        if (
            grammar is None
            or not req.closing.applies
            or req.finished
            or req.closing.job is not None
        ):
            return
        room = self.room(req)
        if req.closing.path is not None:
            if room - len(req.closing.path) > self.slack:
                req.closing.tokens = len(req.closing.path)
                req.closing.found_at = len(req.output_ids)
                req.closing.path = None
            return
        if room > self._predicted(req) + self.slack:
            return
        if self._expected(req) > CLOSING_INLINE_MAX_TOKENS or req.closing.misses:
            self.jobs.start(req, self._search(), max(room, 0))
            return
        tokens = self._search().shortest_completion(
            grammar, max(room, 0), time_limit=CLOSING_STEP_SECONDS
        )
        self._found(req, tokens, room)

    def steps_before(self, req: Request) -> int | None:
        """How many tokens `req` may take before `check` would look at it again (None: no
        limit; 0 while it steers), so that a decode burst ends where single steps would look."""
        if req.constraint.grammar is None or not req.closing.applies or req.closing.job is not None:
            return None
        if req.closing.path is not None:
            return 0
        gap = self.room(req) - self._predicted(req) - self.slack
        return max(0, -(-gap // (1 + CLOSING_GROWTH_PER_TOKEN)))

    def job_done(self, req: Request) -> None:
        """Takes the finished off-loop search of `req`, as `check` takes its own."""
        job, req.closing.job = req.closing.job, None
        if req.finished or job is None or len(req.output_ids) != req.closing.job_at:
            return
        try:
            tokens = job.result()
        except Exception:  # pragma: no cover - the search raises nothing it does not catch
            tokens = None
        self._found(req, tokens, self.room(req))

    def _expected(self, req: Request) -> int:
        known = req.closing.tokens or req.closing.found_at  # a search has measured it
        return req.closing.tokens if known else CLOSING_MIN_EXPECTED

    def _predicted(self, req: Request) -> int:
        since = len(req.output_ids) - req.closing.found_at
        return self._expected(req) + CLOSING_GROWTH_PER_TOKEN * since

    def _found(self, req: Request, tokens: list[int] | None, room: int) -> None:
        """Steers with `tokens` once the room is down to them (plus `slack`); otherwise records
        their length for the next look. A search that found nothing counts a miss: looked for
        again after some tokens, a few times at most."""
        req.closing.found_at = len(req.output_ids)
        if tokens is None:
            req.closing.misses += 1
            req.closing.applies = req.closing.misses < CLOSING_MAX_MISSES
            return
        req.closing.tokens = len(tokens)
        if room - len(tokens) <= self.slack:
            req.closing.path = list(tokens)
