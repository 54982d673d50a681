"""The llguidance backend: an Earley parser over a lazily built lexer, for regexes, JSON schemas
and context-free grammars (Lark, GBNF). One `LLTokenizer` per tokenizer, one pristine `LLMatcher`
per compiled grammar, and a deep copy of it per request (about a microsecond).

The `LLTokenizer` is built from the tokenizer's own JSON (the `tokenizers` object plait made from
a GGUF file or a Hugging Face folder), so nothing is looked up on a hub.

NOTE: an `LLMatcher` that consumes a token its grammar rejects enters an error state it never
leaves; `try_advance` therefore validates first. `validate_tokens` says 0 for EOS once the
matcher is stopped, so EOS is judged by `is_accepting` instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer

from .base import (
    CompiledGrammar,
    Grammar,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    InvalidRegexError,
    UnsupportedSchemaError,
    bitmask_words,
)
from .bounds import RunawayBounds
from .patterns import ascii_classes
from .schema_features import find_keyword, prepare_schema

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

# Parser limits: each compile and each mask step is bounded in work; the lexer's states (built
# lazily, 1-2 KB each, kept for the grammar's life) are bounded in number.
DEFAULT_PARSER_LIMITS = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 50_000,
    "max_grammar_size": 500_000,
}
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
# llguidance ends an error with the line of its own grammar where it happened and a caret under
# it (`   1 | start: /a(b/`): plait wrote that grammar around the user's regex, so it is dropped.
_GRAMMAR_EXCERPT = re.compile(r"\n\s*\d+ \| .*\n\s*\^+\s*$")


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int | None = None,
        *,
        parser_limits: dict[str, int] | None = None,
        max_digit_run: int = 0,
        max_whitespace_run: int = 0,
        **_ignored: Any,
    ) -> None:
        """`max_digit_run` / `max_whitespace_run`: bounds on runaway digits and whitespace in
        JSON output (`bounds.py`); 0 turns a bound off."""
        if vocab_size is not None and vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"grammar backend: model vocab_size {vocab_size} < tokenizer vocab_size "
                f"{tokenizer.vocab_size}"
            )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.eos_token_ids = tuple(sorted(tokenizer.eos_token_ids))
        self.lltokenizer = LLTokenizer(
            tokenizer.backend.to_str(),
            n_vocab=tokenizer.vocab_size,
            eos_token=list(self.eos_token_ids),
        )
        self.num_words = (tokenizer.vocab_size + 31) // 32
        self.limits = LLParserLimits(**{**DEFAULT_PARSER_LIMITS, **(parser_limits or {})})
        eos_row = np.zeros(self.num_words, dtype=np.int32)
        for token_id in self.eos_token_ids:
            eos_row.view(np.uint32)[token_id // 32] |= np.uint32(1 << (token_id % 32))
        self.eos_row = eos_row
        self.bounds = RunawayBounds(tokenizer.vocab_bytes(), max_digit_run, max_whitespace_run)
        self.executor = LLExecutor()  # the thread pool that fills a batch's masks
        # `format` names llguidance was found to know, or not (each probed once, on a tiny schema)
        self._known_formats: set[str] = set()
        self._unknown_formats: set[str] = set()

    def compile(self, key: GrammarKey) -> LLGuidanceCompiledGrammar:
        if key.kind == "json_schema":
            grammar, matcher = self._json_matcher(key)
        else:
            if key.kind == "regex":
                grammar = LLMatcher.grammar_from_regex(ascii_classes(key.pattern))
            else:
                grammar = _grammar_from_text(key.pattern)
            if key.prefix:
                grammar = _with_prefix(grammar, key.prefix)
            matcher = self._matcher(key, grammar)
        bounded = key.kind == "json_schema"
        return LLGuidanceCompiledGrammar(key, grammar, matcher, self, bounded)

    def _json_matcher(self, key: GrammarKey) -> tuple[str, LLMatcher]:
        """The schema's grammar and its pristine matcher: built once, again only for each
        unknown format the parser names (or the token-healing prefix)."""
        schema = json.loads(key.pattern)
        options = _json_options(key.json_whitespace)
        dropped_formats = self._unknown(_format_names(schema))
        for _ in range(16):  # each round drops one unknown format name the probe missed
            grammar = LLMatcher.grammar_from_json_schema(
                prepare_schema(schema, dropped_formats), overrides=options
            )
            matcher = LLMatcher(self.lltokenizer, grammar, log_level=0, limits=self.limits)
            if not matcher.is_error():
                break
            error = matcher.get_error()
            unknown = _UNKNOWN_FORMAT.search(error)
            if not unknown or unknown.group(1) in dropped_formats:
                raise _schema_error(schema, error)
            # NOTE: Draft 2020-12: a format a validator does not know is an annotation
            dropped_formats.add(unknown.group(1).strip("\"'`,."))
        else:
            raise _schema_error(schema, matcher.get_error())
        if key.prefix:
            grammar = _with_prefix(grammar, key.prefix)
            matcher = self._matcher(key, grammar)
        return grammar, matcher

    def _unknown(self, names: set[str]) -> set[str]:
        """Which of `names` llguidance does not know as a `format`: one tiny compile per new
        name, instead of a whole schema's compile per unknown name."""
        for name in names - self._known_formats - self._unknown_formats:
            probe = LLMatcher.grammar_from_json_schema({"type": "string", "format": name})
            matcher = LLMatcher(self.lltokenizer, probe, log_level=0, limits=self.limits)
            unknown = matcher.is_error() and _UNKNOWN_FORMAT.search(matcher.get_error())
            (self._unknown_formats if unknown else self._known_formats).add(name)
        return names & self._unknown_formats

    def _matcher(self, key: GrammarKey, grammar: str) -> LLMatcher:
        matcher = LLMatcher(self.lltokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            error = matcher.get_error()
            if key.kind == "json_schema":
                raise _schema_error(json.loads(key.pattern), error)
            if key.kind == "regex":
                error = _GRAMMAR_EXCERPT.sub("", _whole(error))
                raise InvalidRegexError(f"regex: cannot compile {_shown(key.pattern)!r}: {error}")
            raise GrammarError(f"grammar: {_whole(error)}")
        return matcher


def _format_names(node: Any) -> set[str]:
    """Every string a `format` keyword holds in `node` (and some it need not: a `format` key in
    an example value is probed too, harmlessly)."""
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            value = item.get("format")
            if isinstance(value, str):
                found.add(value)
            stack.extend(v for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (dict, list)))
    return found


def _json_options(json_whitespace: str) -> dict[str, Any]:
    """llguidance's JSON settings for one spacing (`JSON_WHITESPACE`)."""
    if json_whitespace == "flexible":
        return {"whitespace_flexible": True, "whitespace_pattern": "[ \\t\\n\\r]*"}
    spaced = json_whitespace == "conventional"
    return {
        "whitespace_flexible": False,
        "item_separator": ", " if spaced else ",",
        "key_separator": ": " if spaced else ":",
    }


def _with_prefix(grammar: str, prefix: str) -> str:
    """`grammar` (llguidance's JSON form) preceded by the literal `prefix`: a Lark start rule
    that names the original as a nested grammar."""
    # the grammar_from_* helpers give llguidance's JSON form, or plain Lark for a Lark grammar
    spec = (
        json.loads(grammar)
        if grammar.lstrip().startswith("{")
        else {"grammars": [{"lark_grammar": grammar}]}
    )
    body = spec["grammars"]
    body[0]["name"] = "plait_body"
    start = {"lark_grammar": f"start: {json.dumps(prefix)} @plait_body"}
    return json.dumps({**spec, "grammars": [start, *body]})


def _grammar_from_text(text: str) -> str:
    """Lark as llguidance reads it, or GBNF / EBNF (`root ::= ...`), converted to Lark."""
    if "::=" in text:
        try:
            return llguidance.grammar_from("gbnf", text)
        except ValueError as e:
            raise GrammarError(f"grammar: {_whole(e)}") from None
    return LLMatcher.grammar_from_lark(text)


def _schema_error(schema: Any, error: str) -> GrammarError:
    error = _first_line(error)
    unimplemented = _UNIMPLEMENTED.search(error)
    if unimplemented:
        keyword = unimplemented.group(1)
        where = find_keyword(schema, keyword) or "#"
        return UnsupportedSchemaError(
            f"json_schema: {keyword!r} at {where} is not supported by constrained decoding"
        )
    if "oneOf" in error:
        where = find_keyword(schema, "oneOf") or "#"
        return UnsupportedSchemaError(
            f"json_schema: 'oneOf' at {where} has alternatives that may overlap; constrained "
            f"decoding cannot enforce 'exactly one' (use 'anyOf' if any match will do)"
        )
    return UnsupportedSchemaError(f"json_schema: {error}")


def _first_line(error: Any) -> str:
    return " ".join(str(error).strip().split("\n")[0].split()) or type(error).__name__


def _whole(error: Any) -> str:
    """Every line of the message, indentation kept: a caret line points into the line above."""
    lines = [line.rstrip() for line in str(error).strip("\n").splitlines()]
    return "\n".join(lines).strip() or type(error).__name__


def _shown(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


class LLGuidanceCompiledGrammar(CompiledGrammar):
    def __init__(
        self,
        key: GrammarKey,
        grammar: str,
        matcher: LLMatcher,
        backend: LLGuidanceBackend,
        bounded: bool,
    ) -> None:
        self.key = key
        self.regex = key.pattern if key.kind == "regex" else ""
        self.grammar = grammar
        self.matcher = matcher  # pristine: only ever deep-copied
        self.backend = backend
        self.bounded = bounded  # runaway digits and whitespace are bounded (JSON)

    def new_grammar(self) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(self, self.matcher.deep_copy(), [])


class LLGuidanceGrammar(Grammar):
    __slots__ = ("_compiled", "_matcher", "_tokens")

    def __init__(
        self, compiled: LLGuidanceCompiledGrammar, matcher: LLMatcher, tokens: list[int]
    ) -> None:
        self._compiled = compiled
        self._matcher = matcher
        self._tokens = tokens

    @property
    def token_ids(self) -> Sequence[int]:
        return self._tokens

    @property
    def compiled(self) -> LLGuidanceCompiledGrammar:
        return self._compiled

    def _finished(self) -> bool:
        return bool(self._tokens) and self._tokens[-1] in self._compiled.backend.eos_token_ids

    def try_advance(self, token_id: int) -> bool:
        m = self._matcher
        if self._finished() or m.is_error():
            return False
        if token_id in self._compiled.backend.eos_token_ids:
            if not m.is_accepting():
                return False
        elif (
            token_id >= self._compiled.backend.num_words * 32 or m.validate_tokens([token_id]) != 1
        ):
            return False
        if not m.consume_token(token_id):  # pragma: no cover - validated above
            return False
        self._tokens.append(token_id)
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        backend = self._compiled.backend
        n = backend.num_words
        words = bitmask_words(bitmask, n)
        target = words[row]
        if self._finished() or self._matcher.is_error():
            target[:n] = backend.eos_row
        else:
            self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, 4 * n)
            if not target[:n].any():  # a dead end: EOS ends the request instead of all -inf
                target[:n] = backend.eos_row
            elif self._compiled.bounded:
                backend.bounds.apply(target[:n], self._tokens)
        if words.shape[1] > n:
            target[n:] = 0

    @classmethod
    def fill_many(cls, items: Sequence[tuple[Grammar, int]], bitmask: Any) -> None:
        """Every live row in one `LLExecutor` call: llguidance computes the masks on its own
        threads with the GIL released."""
        backend = items[0][0]._compiled.backend if items else None  # type: ignore[attr-defined]
        words = bitmask.numpy() if hasattr(bitmask, "numpy") else bitmask
        if (
            backend is None
            or len(items) < 2
            or words.shape[1] != backend.num_words
            or not words.flags.c_contiguous
            or any(g._compiled.backend is not backend for g, _ in items)  # type: ignore[attr-defined]
        ):
            super().fill_many(items, bitmask)
            return
        live = []
        for grammar, row in items:
            g: LLGuidanceGrammar = grammar  # type: ignore[assignment]
            if g._finished() or g._matcher.is_error():
                words[row] = backend.eos_row
            else:
                live.append((g, row))
        if live:
            backend.executor.unsafe_compute_mask_ptr(
                [(g._matcher, row) for g, row in live],
                words.ctypes.data,
                4 * words.shape[1],
                words.shape[0],
            )
        for g, row in live:
            target = words[row]
            if not target.any():
                target[:] = backend.eos_row
            elif g._compiled.bounded:
                backend.bounds.apply(target, g._tokens)

    def accepts_eos(self) -> bool:
        return self._finished() or self._matcher.is_accepting()

    def accepts_after(self, token_ids: Sequence[int]) -> bool:
        backend = self._compiled.backend
        if self._finished() or self._matcher.is_error():
            return not token_ids and self._finished()
        if any(t >= backend.num_words * 32 for t in token_ids):
            return False
        # NOTE: llguidance validates EOS only in an accepting state: one call, nothing consumed
        ends = bool(token_ids) and token_ids[-1] in backend.eos_token_ids
        tokens = list(token_ids) if ends else [*token_ids, backend.eos_token_ids[0]]
        return self._matcher.validate_tokens(tokens) == len(tokens)

    def is_terminated(self) -> bool:
        return self._finished() or self._matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._tokens):
            raise ValueError(
                f"rollback: {num_tokens} tokens requested, {len(self._tokens)} consumed"
            )
        if num_tokens == 0:
            return
        del self._tokens[-num_tokens:]
        if not self._matcher.rollback(num_tokens):  # past its history: replay from the start
            self._matcher = self._compiled.matcher.deep_copy()
            if self._tokens and not self._matcher.consume_tokens(self._tokens):
                raise RuntimeError("rollback: replaying the kept tokens failed")

    def copy(self) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(self._compiled, self._matcher.deep_copy(), list(self._tokens))

    def try_jump_forward(self) -> str | None:
        if self._finished() or self._matcher.is_error():
            return None
        forced = self._matcher.compute_ff_bytes()
        if not forced:
            return None
        # never end inside a UTF-8 character
        for cut in range(min(4, len(forced)) + 1):
            try:
                return forced[: len(forced) - cut].decode("utf-8") or None
            except UnicodeDecodeError:
                continue
        return None
