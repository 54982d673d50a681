"""Request constraint parameters (`regex`, `json_schema`, `grammar`, `choices`, `dtype`) -> a
`GrammarKey`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..protocol import JSON_WHITESPACE
from .base import GrammarError, GrammarKey
from .json_schema import json_schema_to_regex, normalize_json_schema
from .limits import DEFAULT_LIMITS, check_regex
from .patterns import ascii_classes, choices_regex, dtype_regex, escape


def make_grammar_key(
    *,
    regex: str | None = None,
    json_schema: Any = None,
    grammar: str | None = None,
    choices: Sequence[str] | None = None,
    dtype: type | str | None = None,
    json_whitespace: str = "conventional",
    prefix: str = "",
) -> GrammarKey | None:
    """The key to compile for a request, or None when it has no constraint.

    Cheap (nothing is compiled) and strict: at most one constraint, and a schema that is not
    valid JSON Schema, or a constraint past the size limits, raises a `GrammarError` here, at
    submit time. What a backend cannot express fails in `GrammarBackend.compile`, still before
    the request is queued.
    `prefix` (token healing): text the output must start with; without a constraint the key
    accepts anything after it.
    """
    key = _make_key(regex, json_schema, grammar, choices, dtype, json_whitespace)
    if not prefix:
        return key
    if key is None:
        return GrammarKey("regex", ANYTHING, prefix=prefix)
    return GrammarKey(key.kind, key.pattern, key.json_whitespace, prefix)


ANYTHING = "(?s:.*)"
# each JSON spacing as the regex between JSON tokens of outlines-core's schema builder (which has
# no separators of its own: conventional spacing is an optional space at every such place)
OUTLINES_WHITESPACE = {"conventional": "[ ]?", "compact": "", "flexible": "[ \\t\\n\\r]*"}


def _make_key(
    regex: Any, json_schema: Any, grammar: Any, choices: Any, dtype: Any, json_whitespace: Any
) -> GrammarKey | None:
    given = {
        name: value
        for name, value in (
            ("regex", regex),
            ("json_schema", json_schema),
            ("grammar", grammar),
            ("choices", choices),
            ("dtype", dtype),
        )
        if value is not None
    }
    if len(given) > 1:
        raise GrammarError(
            f"constraint: give at most one of regex, json_schema, grammar, choices, dtype; got "
            f"{', '.join(given)}"
        )
    if not given:
        return None
    if regex is not None:
        return GrammarKey("regex", _checked_text("regex", regex))
    if grammar is not None:
        return GrammarKey("grammar", _checked_text("grammar", grammar))
    if choices is not None:
        try:
            return GrammarKey("regex", choices_regex(choices))
        except ValueError as e:
            raise GrammarError(str(e)) from e
    if dtype is not None:
        try:
            return GrammarKey("regex", dtype_regex(dtype))
        except ValueError as e:
            raise GrammarError(str(e)) from e
    if json_whitespace not in JSON_WHITESPACE:
        raise GrammarError(
            f"json_whitespace: expected one of {', '.join(JSON_WHITESPACE)}, "
            f"got {json_whitespace!r}"
        )
    return GrammarKey("json_schema", normalize_json_schema(json_schema), json_whitespace)


def _checked_text(name: str, text: Any) -> str:
    if not isinstance(text, str):
        raise GrammarError(f"{name}: expected a string, got {type(text).__name__}")
    if not text:
        raise GrammarError(f"{name}: the {name} is empty")
    if len(text) > DEFAULT_LIMITS.max_text_chars:
        raise GrammarError(
            f"{name}: {len(text)} characters; the limit is {DEFAULT_LIMITS.max_text_chars}"
        )
    return text


def grammar_key_to_regex(key: GrammarKey) -> str:
    """The regex of a key, for a regex-automaton backend; limits of such automata checked."""
    if key.kind == "grammar":
        raise GrammarError(
            "grammar: context-free grammars need the llguidance grammar backend "
            "(grammar_backend='llguidance' or 'auto')"
        )
    if key.kind == "regex":
        check_regex(key.pattern)
        regex = ascii_classes(key.pattern)
    else:
        regex = json_schema_to_regex(key.pattern, OUTLINES_WHITESPACE[key.json_whitespace])
        check_regex(regex, "json_schema", generated=True)
    return f"{escape(key.prefix)}(?:{regex})" if key.prefix else regex
