"""One generation request as the engine keeps it: its prompt, its output, and its state in typed
parts (`sampling`: the caller's sampling parameters and logprob options, and its seed's generator;
`constraint`: constrained decoding; `kv`: where its KV lives; `spec`: speculative decoding;
`closing`: budget-aware closing; `healing`: token healing; `delivery`: how its updates reach the
caller). Python data throughout (a seeded request's `torch.Generator` is its random state, not
a tensor); the runners' tensors of it, its page rows among them, live in the runners.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Container, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plait.runtime.protocol import FinishReason, LogprobOptions, SamplingParams

if TYPE_CHECKING:
    import torch

    from plait.radix_cache.node import TreeNode
    from plait.runtime.constrained.base import Grammar
    from plait.runtime.detokenizer import IncrementalDetokenizer
    from plait.runtime.speculative.ngram import NgramIndex


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingState:
    """What a request asked for and how its tokens are drawn: its sampling parameters (budget,
    stops, constraint, sampling), its logprob options, and the generator its seed draws from
    (None: the engine's shared one)."""

    params: SamplingParams
    logprob: LogprobOptions = field(default_factory=LogprobOptions)
    generator: torch.Generator | None = None

    def stop_ids(self, eos_ids: Iterable[int]) -> list[int]:
        """The token ids that end the request, ascending: its `stop_token_ids`, and the model's
        `eos_ids` unless it ignores EOS."""
        p = self.params
        return sorted(set(p.stop_token_ids).union(() if p.ignore_eos else eos_ids))

    def stops_at(self, token: int, eos_ids: Container[int]) -> bool:
        """Whether `token` is one of `stop_ids(eos_ids)` (without building the set)."""
        p = self.params
        return token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids)


@dataclass
class ConstraintState:
    """Constrained decoding of one request: its grammar's state (None: unconstrained, or free once
    token healing is done) and how many tokens jump-forward appended (text the grammar forced)."""

    grammar: Grammar | None = None
    jump_forward_tokens: int = 0


@dataclass
class SpecState:
    """Speculative decoding bookkeeping of one request."""

    index: NgramIndex | None = None  # the n-gram drafter's index over the request's tokens
    draft_valid: int = 0  # tokens whose KV a separate draft model has computed
    mean_accepted: float = 1.0
    backoff: int = 0
    next_backoff: int = 0
    num_steps: int = 0  # verification steps
    num_proposed: int = 0
    num_accepted: int = 0


@dataclass
class KVState:
    """Where a request's KV lives (the KV cache manager's, `kv_cache_manager.py`): its page table
    and how many leading tokens of `all_ids` have KV in it."""

    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_pages: int = 0  # leading pages owned by the radix tree, locked via last_node
    # pages[i:] for i >= pages_stale_from may differ from the int64 copy of the table the model
    # runners read (`page_tables.PageRows`): the KV cache manager lowers it whenever it replaces
    # or drops pages; appended pages need no mark
    pages_stale_from: int = 0
    last_node: TreeNode | None = None
    # sliding-window models: pages[window_from:] have their window pages (the tree's ones locked
    # for this request), pages before it were released for the sliding layers (`WindowPages`)
    window_from: int = 0
    matched_pages: int = 0  # pages[:matched_pages] were the tree's when the request was admitted


@dataclass
class ClosingState:
    """Budget-aware closing of one constrained request (`budget_closing.py`): whether it applies,
    the last closing length found, the closing it steers by (None: not steering), a search off the
    loop, and whether the budget changed the output."""

    applies: bool = False
    path: list[int] | None = None
    tokens: int = 0
    found_at: int = 0  # output length when `tokens` was found
    # a closing search off the loop (`closing_jobs.py`): its closing or None; the request waits
    job: Future[list[int] | None] | None = None
    job_at: int = 0  # output length when it started
    misses: int = 0
    closed_early: bool = False


@dataclass
class HealState:
    """Token healing of one request: the text of the prompt token backed up over (the output
    starts with it, and it is cut from what is returned); `free`: no constraint after it (dropped
    once written); `tokens`: leading output tokens that only rewrite it (not counted as output)."""

    text: str = ""
    free: bool = False
    tokens: int = 0


@dataclass
class Delivery:
    """How a request's updates reach its caller: the detokenizer that turns its tokens into text,
    the sink that takes (update, final) from the engine, and whether that sink takes every update
    (a stream) or only the final one."""

    detokenizer: IncrementalDetokenizer | None = None
    sink: Callable[[dict, bool], None] | None = None
    streaming: bool = False


@dataclass(eq=False)  # a request is itself: compared and hashed by identity
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingState
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    kv: KVState = field(default_factory=KVState)
    admit_order: int = -1
    cached_tokens: int = 0
    # Results
    text: str = ""
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Bookkeeping
    arrival_time: float = field(default_factory=time.perf_counter)
    deadline: float | None = None  # perf_counter time after which the engine aborts it (504)
    client_id: str = ""  # whose request it is: the scheduler admits clients fairly
    first_token_time: float | None = None
    finish_time: float | None = None
    constraint: ConstraintState = field(default_factory=ConstraintState)
    spec: SpecState = field(default_factory=SpecState)
    closing: ClosingState = field(default_factory=ClosingState)
    healing: HealState = field(default_factory=HealState)
    delivery: Delivery = field(default_factory=Delivery)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """`all_ids[start:end]` (0 <= start <= end) without building `all_ids`: a decode step reads
        one token of a long context, so copying the whole context per step and request adds up."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens counted against `max_new_tokens`: not those that only rewrite the text
        token healing backed up over (that text is the prompt's)."""
        return len(self.output_ids) - self.healing.tokens

    @property
    def budget_left(self) -> int:
        """Output tokens it may still add under `max_new_tokens` (the context aside)."""
        return self.sampling.params.max_new_tokens - self.num_output_tokens

    def tokens_left(self, context_len: int) -> int:
        """Tokens it may still add: its `budget_left` and the context's room, whichever is less
        (it finishes once it holds `context_len` tokens)."""
        return min(self.budget_left, context_len - self.num_tokens)

    @property
    def last_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def logprob_start(self) -> int:
        """First prompt position that gets an input logprob entry (its own logprob is null)."""
        start = self.sampling.logprob.logprob_start_len
        last = len(self.prompt_ids) - 1
        return last if start < 0 else min(start, last)
