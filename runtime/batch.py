"""What the scheduler hands the model runner each step, and what comes back: plain Python state
(requests, positions, token ids), no tensors, so scheduling code never needs the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plait.runtime.request import Request

if TYPE_CHECKING:
    from plait.runtime.burst_streams import StreamedTokens


@dataclass
class ExtendEntry:
    """Compute KV for `req.all_ids[start:end]`; positions before `start` are already cached."""

    req: Request
    start: int
    end: int
    is_last_chunk: bool

    @property
    def draft_ids(self) -> list[int]:
        """No draft: an extend's rows are its tokens alone (as a `VerifyEntry`'s without one)."""
        return []


@dataclass
class VerifyEntry:
    """Speculative verification: compute KV for `req.all_ids[start:end]` followed by `draft_ids`,
    and score each draft position, in one pass. The scheduler makes one from a decode (`start` is
    its last token); a draft model catching up on its own KV reads the same shape with an earlier
    `start` (`speculative/model_drafter.py`)."""

    req: Request
    start: int
    end: int
    draft_ids: list[int]
    num_accepted: int = 0  # of the draft, set after verification
    is_last_chunk: bool = True  # the request's tokens are all cached after it (as a decode's)


@dataclass
class ScheduleBatch:
    """A step's work. The forward's rows and the results come in one order: `extends`, then
    `verifies`, then `decodes` (`requests()`)."""

    extends: list[ExtendEntry] = field(default_factory=list)
    verifies: list[VerifyEntry] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    # requests outside the batch wait for their turn (queued, mid-prefill or quarantined): a
    # burst of decode steps would hold them up
    others_waiting: bool = False

    @property
    def queried(self) -> list[ExtendEntry | VerifyEntry]:
        """The entries with query rows of their own (attention's extends), in order."""
        return [*self.extends, *self.verifies]

    def requests(self) -> list[Request]:
        return [e.req for e in self.extends] + [v.req for v in self.verifies] + self.decodes

    def drafts(self) -> dict[Request, list[int]]:
        """The draft each verifying request verifies, by request (those with one)."""
        return {v.req: v.draft_ids for v in self.verifies if v.draft_ids}

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV one decode step of the batch computes (a verification counts its real
        token, not its draft)."""
        return self.computed_tokens(1)

    def computed_tokens(self, decode_steps: int) -> int:
        """Tokens whose KV the batch computes when its decodes run `decode_steps` steps (a
        burst: more than one)."""
        return sum(e.end - e.start for e in self.queried) + len(self.decodes) * decode_steps

    def __bool__(self) -> bool:
        return bool(self.extends or self.verifies or self.decodes)


@dataclass
class TokenResult:
    """What one forward pass produced for one request: usually one new token, several when a
    speculative draft was (partly) accepted."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[tuple[float, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]]] = field(default_factory=list)
    # a request steering toward its closing (`budget_closing.py`): the model's next-best allowed
    # tokens, best first, and their logprobs where logprobs are returned
    alternatives: list[int] = field(default_factory=list)
    alternative_logprobs: list[float] = field(default_factory=list)


@dataclass
class RequestResult:
    """One request's part of a step: its tokens, and the entry it ran as (an extend, a
    verification, or neither: a decode)."""

    req: Request
    tokens: TokenResult
    extend: ExtendEntry | None = None
    verify: VerifyEntry | None = None
    streamed: StreamedTokens | None = None  # what a burst handed on already (`burst_streams.py`)

    @property
    def prompt_done(self) -> bool:
        """Whether the request's prompt is all computed after the step (its last chunk, a
        verification or a decode): a token was due."""
        return self.extend is None or self.extend.is_last_chunk


@dataclass
class StepResults:
    """What the runner hands back for a step: a result per request, the decode steps it ran
    (more than one in a burst) and the forward's seconds per decode step."""

    results: list[RequestResult]
    decode_steps: int
    step_s: float
