"""Canned values that satisfy a constraint, so `MockBackend` honours regex and JSON schemas."""

from __future__ import annotations

import re
import string
from typing import Any

try:  # Python 3.11+
    import re._constants as sre_c
    import re._parser as sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as sre_c  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

_CATEGORY = {
    sre_c.CATEGORY_DIGIT: r"\d",
    sre_c.CATEGORY_NOT_DIGIT: r"\D",
    sre_c.CATEGORY_SPACE: r"\s",
    sre_c.CATEGORY_NOT_SPACE: r"\S",
    sre_c.CATEGORY_WORD: r"\w",
    sre_c.CATEGORY_NOT_WORD: r"\W",
}
_CANDIDATES = "a0x_ -." + string.ascii_letters + string.digits + string.punctuation


def example_for_regex(pattern: str) -> str:
    """A short string matching `pattern` (first branch of each alternation, fewest repeats)."""
    out = _emit(sre_parse.parse(pattern))
    if re.fullmatch(pattern, out) is None:
        raise ValueError(f"mock: cannot produce a string for regex {pattern!r}; pass responses=")
    return out


def _emit(items: Any) -> str:
    return "".join(_emit_one(op, arg) for op, arg in items)


def _emit_one(op: Any, arg: Any) -> str:
    if op is sre_c.LITERAL:
        return chr(arg)
    if op is sre_c.NOT_LITERAL:
        return "a" if arg != ord("a") else "b"
    if op is sre_c.ANY:
        return "a"
    if op is sre_c.IN:
        return next(c for c in _CANDIDATES if _in_set(c, arg))
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", None)):
        low, _high, sub = arg
        return _emit(sub) * low
    if op is sre_c.SUBPATTERN:
        return _emit(arg[-1])
    if op is sre_c.BRANCH:
        return _emit(arg[1][0])
    if op in (sre_c.AT, sre_c.ASSERT, sre_c.ASSERT_NOT):
        return ""
    raise ValueError(f"mock: regex construct {op} is not supported; pass responses=")


def _in_set(ch: str, items: list[tuple[Any, Any]]) -> bool:
    negate = bool(items) and items[0][0] is sre_c.NEGATE
    hit = False
    for op, arg in items:
        if op is sre_c.LITERAL:
            hit |= ch == chr(arg)
        elif op is sre_c.RANGE:
            hit |= arg[0] <= ord(ch) <= arg[1]
        elif op is sre_c.CATEGORY:
            hit |= re.fullmatch(_CATEGORY.get(arg, r"(?!)"), ch) is not None
    return hit != negate


def example_for_schema(schema: Any, defs: dict[str, Any] | None = None) -> Any:
    """A small instance of a JSON schema (required properties, first options, minimums)."""
    if not isinstance(schema, dict):
        return None
    defs = {**(defs or {}), **schema.get("$defs", {})}
    if "$ref" in schema:
        return example_for_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "const" in schema:
        return schema["const"]
    if "default" in schema:
        return schema["default"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example_for_schema(schema[key][0], defs)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties", {})
        return {
            k: example_for_schema(props[k], defs) for k in schema.get("required", []) if k in props
        }
    if kind == "array":
        count = max(schema.get("minItems", 1), 0)
        if "maxItems" in schema:
            count = min(count, schema["maxItems"])
        return [example_for_schema(schema.get("items", {}), defs) for _ in range(count)]
    if kind == "string":
        return "x" * max(schema.get("minLength", 1), 1)
    if kind == "integer":
        return int(schema.get("minimum", 0))
    if kind == "number":
        return float(schema.get("minimum", 0.0))
    if kind == "boolean":
        return True
    return None
