"""The drafter interface, its registry, and the per-request adaptive gate."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.runtime.request import Request
from plait.runtime.tuning import BACKOFF_STEPS, MAX_BACKOFF_STEPS, MIN_MEAN_ACCEPTED
from plait.runtime.tuning import SPECULATION_GATE_EMA as EMA

if TYPE_CHECKING:
    import torch

    from plait.runtime.config import EngineConfig
    from plait.runtime.kv_cache_manager import KVCacheManager
    from plait.runtime.model_runner import ModelRunner
    from plait.runtime.models.args import ModelArgs


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may use of the engine it drafts for: the configuration (`draft_layers`,
    `draft_model_path`), the target's shapes and runner, the KV cache manager that grows a
    request's pages for its draft, and what a draft model's own pool and runner are built like."""

    config: EngineConfig
    args: ModelArgs
    runner: ModelRunner
    kv: KVCacheManager
    num_pages: int
    page_size: int
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: Collection[int]
    generator: torch.Generator


class Drafter(ABC):
    """Proposes draft tokens for running requests. Proposals are deterministic (one-hot draft
    distributions) unless `propose` also returns probabilities.

    Invariant: a drafter never changes a request's tokens; verification decides what lands.
    """

    name: str

    @abstractmethod
    def propose(self, reqs: list[Request], num_tokens: int) -> list[list[int]]:
        """Up to `num_tokens` draft tokens per request (possibly none)."""

    def wants(self, req: Request) -> bool:
        """The adaptive gate: speculate unless recent proposals were mostly rejected."""
        state = req.spec
        if state.backoff > 0:
            state.backoff -= 1
            return False
        return True

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        state = req.spec
        state.mean_accepted = EMA * state.mean_accepted + (1 - EMA) * accepted
        if proposed and state.mean_accepted < MIN_MEAN_ACCEPTED:
            state.next_backoff = min(max(state.next_backoff * 2, BACKOFF_STEPS), MAX_BACKOFF_STEPS)
            state.backoff = state.next_backoff
            state.mean_accepted = MIN_MEAN_ACCEPTED + 0.4  # try again, briefly, after the back-off
        elif accepted:
            state.next_backoff = 0


_DRAFTERS: dict[str, Callable[..., Drafter]] = {}


def register_drafter(name: str, factory: Callable[..., Drafter]) -> None:
    _DRAFTERS[name] = factory


def create_drafter(name: str, **options: Any) -> Drafter:
    if name not in _DRAFTERS:
        raise ValueError(
            f"speculative_algorithm: unknown {name!r}; known: {', '.join(sorted(_DRAFTERS))}"
        )
    return _DRAFTERS[name](**options)


def _ngram(**options: Any) -> Drafter:
    from plait.runtime.speculative.ngram import NgramDrafter

    return NgramDrafter(**options)


def _model(name: str) -> Callable[..., Drafter]:
    def make(**options: Any) -> Drafter:
        from plait.runtime.speculative.model_drafter import ModelDrafter

        return ModelDrafter(name=name, **options)

    return make


register_drafter("ngram", _ngram)
register_drafter("self", _model("self"))
register_drafter("draft_model", _model("draft_model"))
