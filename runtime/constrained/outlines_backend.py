"""The outlines-core backend: one `Vocabulary` per tokenizer, one `Index` per pattern, a `Guide`
per request.

NOTE: outlines-core 0.2.14 drops every token whose last byte leaves an accepting state for a
non-accepting one (`a(-b)?` never emits "-"; fixed upstream after the release), and its
leftmost-first automaton stops at the first alternative that matches (`(a|ab)` never emits "ab").
Both vanish when the index is built for `(?:R)S`, with S a sentinel character no token contains:
nothing is accepted before S, so every continuation of R survives. A state then accepts R when the
sentinel token leads from it to a final state; the sentinel never appears in a mask. Tokenizers
whose tokens use every byte get the plain regex (and the upstream bug).

Two per-pattern caches, filled lazily on the engine loop and shared by every request of the
pattern: the mask row of each visited state (a 6 KB memcpy instead of walking the index), and the
forced-byte step of each state for jump-forward. Forced bytes come from the index itself: a
non-accepting state forces byte `b` when the single-byte token `b` is its only single-byte move
and every allowed token starts with `b`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from outlines_core import Guide, Index, Vocabulary

from .base import (
    CompiledGrammar,
    Grammar,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    InvalidRegexError,
    bitmask_words,
)
from .bounds import RunawayBounds
from .limits import regex_cost
from .patterns import escape
from .sandbox import SUPPORTED, IndexSandbox
from .spec import grammar_key_to_regex

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

_MAX_FORCED_BYTES = 4096
SANDBOX_ABOVE_COST = 200  # limits.regex_cost: at most six wide classes (., \w, [^"]) unrolled


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int | None = None,
        *,
        max_rollback: int = 64,
        max_cached_row_bytes: int = 16 << 20,
        compile_timeout: float | None = None,
        compile_memory_mb: int = 0,
        max_digit_run: int = 0,
        max_whitespace_run: int = 0,
    ) -> None:
        """`compile_timeout` / `compile_memory_mb`: build indexes in a child process that is
        stopped past these (`sandbox.py`); without a timeout they are built in process.
        `max_digit_run` / `max_whitespace_run`: runaway bounds on JSON output (`bounds.py`)."""
        if vocab_size is not None and vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"grammar backend: model vocab_size {vocab_size} < tokenizer vocab_size "
                f"{tokenizer.vocab_size}"
            )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.max_rollback = max_rollback
        self.token_bytes = tokenizer.vocab_bytes()
        self.eos_token_ids = tuple(sorted(tokenizer.eos_token_ids))
        self.num_index_words = (tokenizer.vocab_size + 31) // 32
        excluded = set(tokenizer.special_token_ids) | set(tokenizer.eos_token_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, spelled in enumerate(self.token_bytes):
            if spelled and token_id not in excluded:
                by_bytes.setdefault(spelled, []).append(token_id)
        self.single_byte_tokens = [
            (b[0], ids[0]) for b, ids in sorted(by_bytes.items()) if len(b) == 1
        ]
        first = np.full(len(self.token_bytes), -1, dtype=np.int16)  # first byte of every token
        for spelled, ids in by_bytes.items():
            first[ids] = spelled[0]
        self.first_bytes = first
        self.sentinel = _find_sentinel(by_bytes)
        self.sentinel_id: int | None = None
        if self.sentinel is not None:
            spare = sorted(set(tokenizer.special_token_ids) - set(tokenizer.eos_token_ids))
            self.sentinel_id = spare[0] if spare else tokenizer.vocab_size
            by_bytes = {**by_bytes, self.sentinel.encode("utf-8"): [self.sentinel_id]}
        self.vocabulary = Vocabulary(tokenizer.eos_token_id, by_bytes)
        top_id = max(tokenizer.vocab_size - 1, self.sentinel_id or 0)
        self.num_scratch_words = top_id // 32 + 1  # what the index writes (sentinel included)
        self.max_cached_rows = max(1, max_cached_row_bytes // (4 * self.num_index_words))
        eos_row = np.zeros(self.num_index_words, dtype=np.int32)
        for token_id in self.eos_token_ids:
            _set_bit(eos_row, token_id)
        self.eos_row = eos_row
        keep = np.full(self.num_index_words, -1, dtype=np.int32)  # clears EOS and sentinel bits
        for token_id in (*self.eos_token_ids, self.sentinel_id):
            if token_id is not None and token_id < 32 * self.num_index_words:
                _clear_bit(keep, token_id)
        self.keep_bits = keep
        self.bounds = RunawayBounds(self.token_bytes, max_digit_run, max_whitespace_run)
        self.sandbox: IndexSandbox | None = None
        if compile_timeout is not None and SUPPORTED:
            self.sandbox = IndexSandbox(self.vocabulary, compile_timeout, compile_memory_mb)

    def compile(self, key: GrammarKey) -> OutlinesCompiledGrammar:
        regex = key.pattern  # until the schema's regex is written
        nbytes = 0  # an index built in process is a small one
        try:
            if self.sandbox is not None and key.kind == "json_schema":
                index, regex, nbytes = self.sandbox.build_key(key, self.sentinel)
            else:
                regex = grammar_key_to_regex(key)
                indexed = regex if self.sentinel is None else f"(?:{regex}){escape(self.sentinel)}"
                if self.sandbox is not None and _risky(regex):
                    index, nbytes = self.sandbox.build(indexed, key.kind)
                else:
                    index = Index(indexed, self.vocabulary)
        except GrammarError:
            raise
        # NOTE: Rust panics surface as pyo3's PanicException, a BaseException
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise _compile_error(key, regex, e) from e
        compiled = OutlinesCompiledGrammar(key, regex, index, self)
        compiled.nbytes = nbytes
        initial = index.get_initial_state()
        startable = set(index.get_allowed_tokens(initial)) - {self.sentinel_id}
        if not compiled.accepts(initial) and not startable:
            raise InvalidRegexError(
                f"{key.kind}: no token of this vocabulary can start {_shown(regex)!r}"
            )
        return compiled

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()


def _risky(regex: str) -> bool:
    """Worth a child process: the static cost is above a few atoms, or unknown. The cost model
    misses products (`[^x]{1,50}\\w+` takes seconds), so only patterns too small for them stay in
    process, where short regexes (dates, numbers, choices) skip the round trip. A JSON schema
    always goes to the child, which writes its regex too (`IndexSandbox.build_key`): a schema
    Store config's regex alone can exhaust the memory in process."""
    cost = regex_cost(regex)
    return cost is None or cost > SANDBOX_ABOVE_COST


def _shown(regex: str) -> str:
    return regex if len(regex) <= 80 else regex[:77] + "..."


def _compile_error(key: GrammarKey, regex: str, error: BaseException) -> GrammarError:
    shown = _shown(regex)
    if key.kind == "json_schema":
        return GrammarError(f"json_schema: its regex does not compile: {_first_line(error)}")
    try:
        with warnings.catch_warnings():  # FutureWarning on `[[`: only the error matters here
            warnings.simplefilter("ignore")
            re.compile(regex)
    except re.error as e:
        return InvalidRegexError(f"regex: invalid pattern {shown!r}: {e}")
    message = _first_line(error)
    if "DFA" in message:
        message += " (lookaround, backreferences, word boundaries and anchors are not supported)"
    return InvalidRegexError(f"regex: cannot compile {shown!r}: {message}")


def _first_line(error: BaseException) -> str:
    return " ".join(str(error).split("\n")[0].split()) or type(error).__name__


def _find_sentinel(by_bytes: dict[bytes, list[int]]) -> str | None:
    """A character whose first UTF-8 byte no token contains (so no token can start spelling it)."""
    used = set().union(*(set(spelled) for spelled in by_bytes))
    for byte in [*range(1, 0x20), 0x7F, *range(0xC2, 0xE0), *range(0xE1, 0xED), *range(0xF1, 0xF4)]:
        if byte in used:
            continue
        if byte < 0x80:
            return chr(byte)
        if byte < 0xE0:  # lead byte of a 2-byte character
            return bytes([byte, 0x80]).decode("utf-8")
        return bytes([byte, 0x80, 0x80] if byte < 0xF0 else [byte, 0x80, 0x80, 0x80]).decode(
            "utf-8"
        )
    return None


def _set_bit(words: np.ndarray, token_id: int) -> None:
    words.view(np.uint32)[token_id // 32] |= np.uint32(1 << (token_id % 32))


def _clear_bit(words: np.ndarray, token_id: int) -> None:
    words.view(np.uint32)[token_id // 32] &= ~np.uint32(1 << (token_id % 32))


class OutlinesCompiledGrammar(CompiledGrammar):
    def __init__(self, key: GrammarKey, regex: str, index: Index, backend: OutlinesBackend) -> None:
        self.key = key
        self.regex = regex
        self.index = index
        self.backend = backend
        self._rows: dict[int, np.ndarray] = {}
        # state -> (forced byte, next state), (-1, -1) nothing follows, (-2, -1) several bytes can
        self._steps: dict[int, tuple[int, int]] = {}
        self._accepting: dict[int, bool] = {}

    def new_grammar(self) -> OutlinesGrammar:
        return OutlinesGrammar(self)

    def accepts(self, state: int) -> bool:
        """Does the text that led to `state` match the whole pattern?"""
        sentinel_id = self.backend.sentinel_id
        if sentinel_id is None:
            return self.index.is_final_state(state)
        found = self._accepting.get(state)
        if found is None:
            after = self.index.get_next_state(state, sentinel_id)
            found = after is not None and self.index.is_final_state(after)
            self._accepting[state] = found
        return found

    def mask_row(self, state: int, guide: Guide) -> np.ndarray:
        """The bitmask words of `state` (`guide` must be in it), from the per-state cache."""
        row = self._rows.get(state)
        if row is None:
            backend = self.backend
            scratch = np.zeros(backend.num_scratch_words, dtype=np.int32)
            guide.write_mask_into(scratch.ctypes.data, scratch.size, 4)
            row = scratch[: backend.num_index_words] & backend.keep_bits
            # NOTE: a non-accepting row with no token is a dead end (the pattern needs a character
            # no token spells); allowing EOS ends the request instead of sampling from all -inf.
            if self.accepts(state) or not row.any():
                row |= backend.eos_row
            if len(self._rows) < backend.max_cached_rows:
                self._rows[state] = row
        return row

    def step(self, state: int) -> tuple[int, int]:
        """(byte, next state) when `state` forces one byte; (-1, -1) when no byte can follow;
        (-2, -1) when several can."""
        found = self._steps.get(state)
        if found is None:
            found = self._scan_step(state)
            self._steps[state] = found
        return found

    def _scan_step(self, state: int) -> tuple[int, int]:
        found: tuple[int, int] = (-1, -1)
        for byte, token_id in self.backend.single_byte_tokens:
            next_state = self.index.get_next_state(state, token_id)
            if next_state is not None:
                if found[0] >= 0:
                    return (-2, -1)
                found = (byte, next_state)
        if found[0] >= 0:  # every allowed token must start with that byte (multi-byte tokens too)
            allowed = np.asarray(self.index.get_allowed_tokens(state), dtype=np.int64)
            allowed = allowed[
                (allowed < len(self.backend.first_bytes)) & (allowed != self.backend.sentinel_id)
            ]
            allowed = allowed[~np.isin(allowed, self.backend.eos_token_ids)]
            if np.any(self.backend.first_bytes[allowed] != found[0]):
                return (-2, -1)
        return found

    def forced_bytes(self, state: int) -> bytes:
        out = bytearray()
        while len(out) < _MAX_FORCED_BYTES and not self.accepts(state):
            byte, next_state = self.step(state)
            if byte < 0:
                break
            out.append(byte)
            state = next_state
        return bytes(out)


class OutlinesGrammar(Grammar):
    __slots__ = ("_compiled", "_guide", "_tokens", "_finished")

    def __init__(self, compiled: OutlinesCompiledGrammar) -> None:
        self._compiled = compiled
        self._guide = Guide(compiled.index, max_rollback=compiled.backend.max_rollback)
        self._tokens: list[int] = []
        self._finished = False  # EOS consumed

    @property
    def token_ids(self) -> Sequence[int]:
        return self._tokens

    @property
    def compiled(self) -> OutlinesCompiledGrammar:
        return self._compiled

    @property
    def state(self) -> int:
        """The index state (outlines-core's id)."""
        return self._guide.get_state()

    def try_advance(self, token_id: int) -> bool:
        if self._finished:
            return False
        backend = self._compiled.backend
        if token_id in backend.eos_token_ids:
            row = self._compiled.mask_row(self._guide.get_state(), self._guide)
            if not (row[token_id // 32] >> (token_id % 32)) & 1:  # accepting (or a dead end)
                return False
            self._finished = True
        elif token_id == backend.sentinel_id:
            return False
        else:
            try:
                self._guide.advance(token_id, return_tokens=False)
            except ValueError:
                return False
        self._tokens.append(token_id)
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        backend = self._compiled.backend
        n = backend.num_index_words
        words = bitmask_words(bitmask, n)
        if self._finished:
            words[row, :n] = backend.eos_row
        else:
            words[row, :n] = self._compiled.mask_row(self._guide.get_state(), self._guide)
            if self._compiled.key.kind == "json_schema":
                backend.bounds.apply(words[row, :n], self._tokens)
        if words.shape[1] > n:
            words[row, n:] = 0

    def accepts_eos(self) -> bool:
        return self._finished or self._compiled.accepts(self._guide.get_state())

    def is_terminated(self) -> bool:
        if self._finished:
            return True
        state = self._guide.get_state()
        return self._compiled.accepts(state) and self._compiled.step(state)[0] == -1

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._tokens):
            raise ValueError(
                f"rollback: {num_tokens} tokens requested, {len(self._tokens)} consumed"
            )
        if num_tokens == 0:
            return
        guide_steps = num_tokens - (1 if self._finished else 0)
        self._finished = False
        del self._tokens[-num_tokens:]
        if guide_steps <= self._guide.get_allowed_rollback():
            if guide_steps:
                self._guide.rollback_state(guide_steps)
        else:  # past the guide's history: replay from the start (a table lookup a token)
            self._guide.reset()
            for token_id in self._tokens:
                self._guide.advance(token_id, return_tokens=False)

    def copy(self) -> OutlinesGrammar:
        # NOTE: copy.copy(Guide) pickles the whole index, slow for any real schema; replay.
        twin = OutlinesGrammar(self._compiled)
        eos = self._tokens[-1:] if self._finished else []
        for token_id in self._tokens[: len(self._tokens) - len(eos)]:
            twin._guide.advance(token_id, return_tokens=False)
        twin._tokens = list(self._tokens)
        twin._finished = self._finished
        return twin

    def try_jump_forward(self) -> str | None:
        if self._finished:
            return None
        token_bytes = self._compiled.backend.token_bytes
        if _incomplete_utf8_tail(b"".join(token_bytes[t] for t in self._tokens[-4:])):
            return None
        forced = self._compiled.forced_bytes(self._guide.get_state())
        forced = forced[: len(forced) - _incomplete_utf8_tail(forced)]
        try:
            return forced.decode("utf-8") or None
        except UnicodeDecodeError:
            return None


def _incomplete_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of `data` start a UTF-8 character that is not finished."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # continuation byte
            continue
        if byte < 0xC0:
            return 0
        needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
        return back if back < needed else 0
    return 0
