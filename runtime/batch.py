"""What the scheduler hands the model runner each step, and what comes back: plain Python state
(requests, positions, token ids), no tensors, so scheduling code never needs the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.runtime.request import Request


@dataclass
class ExtendEntry:
    """Compute KV for `req.all_ids[start:end]`; positions before `start` are already cached."""

    req: Request
    start: int
    end: int
    is_last_chunk: bool
    draft_ids: list[int] = field(default_factory=list)  # speculative tokens after all_ids[:end]
    num_accepted: int = 0  # set after verification


@dataclass
class ScheduleBatch:
    extends: list[ExtendEntry] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    decode_steps: int = 1  # steps the decodes ran: more than one in a burst (`decode_burst`)

    @property
    def num_tokens(self) -> int:
        return sum(e.end - e.start for e in self.extends) + len(self.decodes) * self.decode_steps

    def __bool__(self) -> bool:
        return bool(self.extends or self.decodes)


@dataclass
class TokenResult:
    """What one forward pass produced for one request: usually one new token, several when a
    speculative draft was (partly) accepted."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[tuple[float, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]]] = field(default_factory=list)
