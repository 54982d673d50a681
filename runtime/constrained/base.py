"""The constrained-decoding interfaces: a backend compiles a `GrammarKey` once per tokenizer into a
`CompiledGrammar`; each request gets its own `Grammar` state from it. One registry of backends and
`create_grammar_backend("auto" | name, tokenizer)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from ..tokenizer import Tokenizer


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the problem (HTTP 400)."""


class InvalidRegexError(GrammarError):
    """The regex does not parse, or uses a feature the automaton cannot express."""


class InvalidSchemaError(GrammarError):
    """The schema is not JSON, not an object, or not a valid JSON Schema."""


class UnsupportedSchemaError(GrammarError):
    """The schema is valid but uses a feature constrained decoding cannot enforce."""


class TokenRejectedError(ValueError):
    """`Grammar.advance` was given a token the grammar does not allow in its current state."""


GrammarKind = Literal["regex", "json_schema", "grammar"]


@dataclass(frozen=True)
class GrammarKey:
    """What to compile: a regex, a normalised JSON schema (compact JSON) with its whitespace, or a
    context-free grammar (Lark, or GBNF / EBNF with `root ::= ...`).

    `json_whitespace` only matters for JSON schemas: how JSON is spaced
    (`protocol.JSON_WHITESPACE`).
    `prefix`: literal text the output must start with, before what the pattern accepts (token
    healing).
    """

    kind: GrammarKind
    pattern: str
    json_whitespace: str = "conventional"
    prefix: str = ""  # text the output starts with before the pattern (token healing)


class Grammar(ABC):
    """The automaton state of one request's constrained output.

    Invariants: it has consumed exactly the request's output tokens since the constraint began
    (`token_ids`), EOS included once accepted; the rows it fills allow EOS only in accepting
    states, and only EOS once EOS was consumed; `rollback(n)` followed by advancing the same
    tokens restores the same state. Not thread-safe: one request, one thread (the engine loop).
    """

    @property
    @abstractmethod
    def token_ids(self) -> Sequence[int]:
        """The tokens consumed so far (a read-only view)."""

    @abstractmethod
    def try_advance(self, token_id: int) -> bool:
        """Consume `token_id` if the grammar allows it now; False (state unchanged) if not."""

    def advance(self, token_id: int) -> None:
        if not self.try_advance(token_id):
            raise TokenRejectedError(
                f"grammar: token {token_id} is not allowed after {len(self.token_ids)} tokens"
            )

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (CPU int32, 32 tokens per word).

        Bits past the tokenizer's vocabulary (a wider model vocabulary) are cleared.
        """

    @classmethod
    def fill_many(cls, items: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
        """`fill_bitmask` for each (grammar, row) of this class; a backend may do it in one
        call that releases the GIL (`fill_bitmasks`)."""
        for grammar, row in items:
            grammar.fill_bitmask(bitmask, row)

    @abstractmethod
    def accepts_eos(self) -> bool:
        """True in an accepting state: the output so far matches the whole pattern."""

    def accepts_after(self, token_ids: Sequence[int]) -> bool:
        """Whether the grammar would accept after consuming `token_ids`; the state is unchanged."""
        probe = self.copy()
        return all(probe.try_advance(t) for t in token_ids) and probe.accepts_eos()

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when nothing but EOS may follow: EOS was consumed, or the state accepts and has
        no other continuation (the request can finish without sampling)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed tokens (speculative decoding, retokenization)."""

    @abstractmethod
    def copy(self) -> Grammar:
        """An independent state at the same position (for `n > 1` sampling or forks)."""

    @abstractmethod
    def try_jump_forward(self) -> str | None:
        """The longest text every accepted continuation starts with, or None.

        It never crosses an accepting state (where EOS would be an alternative) and ends on a
        UTF-8 character boundary. The grammar does not consume it: see `jump_forward.jump_forward`.
        """

    def replace_tail(self, num_dropped: int, new_token_ids: Sequence[int]) -> bool:
        """Swap the last `num_dropped` tokens for `new_token_ids`; False (state unchanged) if the
        grammar rejects them."""
        dropped = list(self.token_ids[len(self.token_ids) - num_dropped :]) if num_dropped else []
        self.rollback(num_dropped)
        for i, token_id in enumerate(new_token_ids):
            if not self.try_advance(token_id):
                self.rollback(i)
                for old in dropped:
                    self.advance(old)
                return False
        return True


def bitmask_words(bitmask: Any, num_words: int) -> Any:
    """The int32 numpy view of a [batch, words] CPU bitmask (torch tensor or array), checked to
    hold at least `num_words` words per row."""
    words = bitmask.numpy() if hasattr(bitmask, "numpy") else bitmask
    if words.shape[1] < num_words:
        raise ValueError(
            f"fill_bitmask: bitmask has {words.shape[1]} words per row, needs {num_words}"
        )
    return words


def fill_bitmasks(grammars: Sequence[Grammar | None], bitmask: torch.Tensor) -> list[int]:
    """Fills row j of `bitmask` from `grammars[j]` where it is not None, each backend's rows in
    one `fill_many`; returns the rows filled."""
    rows = [j for j, g in enumerate(grammars) if g is not None]
    by_class: dict[type[Grammar], list[tuple[Grammar, int]]] = {}
    for j in rows:
        grammar = grammars[j]
        assert grammar is not None
        by_class.setdefault(type(grammar), []).append((grammar, j))
    for cls, items in by_class.items():
        cls.fill_many(items, bitmask)
    return rows


class CompiledGrammar(ABC):
    """A compiled pattern for one tokenizer: immutable, shared by every request that uses it."""

    key: GrammarKey
    regex: str
    nbytes: int = 0  # memory it holds, where the backend knows it (the cache's byte budget)
    # the shortest output the engine's submit probe found (budget-aware closing), once probed;
    # None where the probe found none in its time
    probed: bool = False
    shortest_output: tuple[int, ...] | None = None

    @abstractmethod
    def new_grammar(self) -> Grammar:
        """A fresh per-request state at the start of the pattern (microseconds)."""


class GrammarBackend(ABC):
    """Compiles grammar keys against one tokenizer; `compile` is thread-safe and may be slow."""

    name: str

    @abstractmethod
    def compile(self, key: GrammarKey) -> CompiledGrammar:
        """Blocking compilation; raises `GrammarError` naming the problem."""


# registry: name -> loader returning the backend class (imported lazily)

GrammarBackendLoader = Callable[[], type[GrammarBackend]]
_BACKENDS: dict[str, GrammarBackendLoader] = {}
_AUTO_ORDER: list[str] = []


def register_grammar_backend(
    name: str, loader: GrammarBackendLoader, *, auto_priority: bool = True
) -> None:
    _BACKENDS[name] = loader
    if auto_priority and name not in _AUTO_ORDER:
        _AUTO_ORDER.append(name)


def available_grammar_backends() -> list[str]:
    return list(_BACKENDS)


def create_grammar_backend(
    name: str, tokenizer: Tokenizer, vocab_size: int | None = None, **options: Any
) -> GrammarBackend:
    """`name` is "auto" (the first registered backend whose dependencies import) or a registered
    name; `vocab_size` is the model's (mask width), at least the tokenizer's."""
    if name == "auto":
        errors = []
        for candidate in _AUTO_ORDER:
            try:
                cls = _BACKENDS[candidate]()
            except ImportError as e:
                errors.append(f"{candidate}: {e}")
                continue
            return cls(tokenizer, vocab_size, **options)  # type: ignore[call-arg]
        raise ImportError(
            f"grammar backend: none available ({'; '.join(errors) or 'none registered'})"
        )
    if name not in _BACKENDS:
        raise ValueError(f"grammar backend: unknown {name!r} (known: auto, {', '.join(_BACKENDS)})")
    return _BACKENDS[name]()(tokenizer, vocab_size, **options)  # type: ignore[call-arg]


def _load_llguidance() -> type[GrammarBackend]:
    from .llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend


def _load_outlines() -> type[GrammarBackend]:
    from .outlines_backend import OutlinesBackend

    return OutlinesBackend


register_grammar_backend("llguidance", _load_llguidance)  # "auto": the first that imports
register_grammar_backend("outlines", _load_outlines)
