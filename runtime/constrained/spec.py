"""Request constraint parameters (`regex`, `json_schema`, `choices`, `dtype`) -> a `GrammarKey`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import GrammarError, GrammarKey
from .json_schema import json_schema_to_regex, normalize_json_schema
from .limits import check_regex
from .patterns import choices_regex, dtype_regex

COMPACT_WHITESPACE = ""


def make_grammar_key(
    *,
    regex: str | None = None,
    json_schema: Any = None,
    choices: Sequence[str] | None = None,
    dtype: type | str | None = None,
    whitespace_pattern: str | None = COMPACT_WHITESPACE,
) -> GrammarKey | None:
    """The key to compile for a request, or None when it has no constraint.

    Cheap (no automaton is built) and strict: at most one constraint, and every schema problem
    the builder can see (invalid JSON or schema, unsupported features) raises a `GrammarError`
    here, at submit time, and so does a pattern past the compile limits (`limits.py`). A regex
    that does not compile fails later, in `GrammarBackend.compile`.
    """
    given = {
        name: value
        for name, value in (
            ("regex", regex),
            ("json_schema", json_schema),
            ("choices", choices),
            ("dtype", dtype),
        )
        if value is not None
    }
    if len(given) > 1:
        raise GrammarError(
            f"constraint: give at most one of regex, json_schema, choices, dtype; got {', '.join(given)}"
        )
    if not given:
        return None
    if regex is not None:
        if not isinstance(regex, str):
            raise GrammarError(f"regex: expected a string, got {type(regex).__name__}")
        check_regex(regex)
        return GrammarKey("regex", regex)
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
    if whitespace_pattern is not None and not isinstance(whitespace_pattern, str):
        raise GrammarError(
            f"whitespace_pattern: expected a string or None, got {type(whitespace_pattern).__name__}"
        )
    key = GrammarKey("json_schema", normalize_json_schema(json_schema), whitespace_pattern)
    regex = json_schema_to_regex(key.pattern, whitespace_pattern)  # raises the named errors now
    check_regex(regex, "json_schema", generated=True)
    return key


def grammar_key_to_regex(key: GrammarKey) -> str:
    if key.kind == "regex":
        return key.pattern
    return json_schema_to_regex(key.pattern, key.whitespace_pattern)
