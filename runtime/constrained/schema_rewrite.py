"""The rewrite pass before outlines-core's JSON-schema builder (see `json_schema.py`): a copy of
the schema the builder handles exactly, with regex placeholders for what plait expresses itself
(numeric bounds, string formats and patterns), or an `UnsupportedSchemaError` naming the keyword
and its JSON pointer."""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable
from typing import Any

from .base import InvalidSchemaError, UnsupportedSchemaError
from .patterns import (
    FORMAT_REGEXES,
    JSON_STRING_REGEX,
    ascii_classes,
    integer_range_regex,
    number_range_regex,
)

_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "$id",
        "$anchor",
        "nullable",
        "discriminator",
        "$defs",
        "definitions",
    }
)
_UNSUPPORTED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "patternProperties",
    "propertyNames",
    "contains",
    "minContains",
    "maxContains",
    "multipleOf",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_TYPE_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minDigits",
        "maxDigits",
    },
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "object": {"properties", "required", "additionalProperties", "minProperties", "maxProperties"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems"},
    "boolean": set(),
    "null": set(),
}


class SchemaRewriter:
    """Walks a schema, returning a copy the builder handles exactly, with regex placeholders."""

    def __init__(
        self, whitespace: str = "", value_regex: Callable[[Any], str] | None = None
    ) -> None:
        """`whitespace`: the builder's regex between JSON tokens; `value_regex`: a schema's
        regex through the builder (for the values of a map whose size is bounded)."""
        self.substitutions: dict[str, str] = {}
        self._nonce = uuid.uuid4().hex[:12]
        self.whitespace = whitespace
        self.value_regex = value_regex

    def _placeholder(self, regex: str) -> dict[str, str]:
        name = f"plait_{self._nonce}_{len(self.substitutions)}"
        self.substitutions[name] = regex
        return {"const": name}

    def rewrite(self, node: Any, path: str) -> Any:
        if node is True:
            return {}
        if not isinstance(node, dict):
            raise UnsupportedSchemaError(
                f"json_schema: {path}: schema {node!r} is not supported here"
            )
        for keyword in _UNSUPPORTED:
            if keyword in node:
                raise UnsupportedSchemaError(f"json_schema: {path}: '{keyword}' is not supported")
        if node.get("uniqueItems") is True:
            raise UnsupportedSchemaError(f"json_schema: {path}: 'uniqueItems' is not supported")
        node = dict(node)
        for defs in ("$defs", "definitions"):
            if isinstance(node.get(defs), dict):
                node[defs] = {
                    k: self.rewrite(v, f"{path}/{defs}/{k}") for k, v in node[defs].items()
                }
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise UnsupportedSchemaError(
                f"json_schema: {path}: external $ref {ref!r} is not supported"
            )
        constraining = set(node) - _ANNOTATIONS
        if not constraining:
            return {k: v for k, v in node.items() if k in ("$defs", "definitions")}
        if "allOf" in node:
            return self._all_of(node, path, constraining)
        if "properties" in node:
            for keyword in ("anyOf", "oneOf", "enum", "const", "$ref", "prefixItems"):
                if keyword in node:
                    raise UnsupportedSchemaError(
                        f"json_schema: {path}: '{keyword}' next to 'properties' is not supported"
                    )
        for keyword in ("anyOf", "oneOf"):
            if keyword in node:
                node[keyword] = [
                    self.rewrite(s, f"{path}/{keyword}/{i}") for i, s in enumerate(node[keyword])
                ]
        if (
            "enum" in node
            or "const" in node
            or "$ref" in node
            or "anyOf" in node
            or "oneOf" in node
        ):
            return node
        kind = node.get("type")
        if isinstance(kind, list):
            if len(kind) == 1:
                kind = node["type"] = kind[0]
            else:
                return self._type_union(node, kind, path)
        if "properties" in node or kind == "object":
            return self._object(node, path)
        if "prefixItems" in node or kind == "array":
            return self._array(node, path)
        if kind == "integer":
            return self._integer(node, path)
        if kind == "number":
            return self._number(node, path)
        if kind == "string":
            return self._string(node, path)
        return node

    def _all_of(self, node: dict[str, Any], path: str, constraining: set[str]) -> Any:
        parts = node["allOf"]
        if len(parts) != 1 or constraining != {"allOf"}:
            raise UnsupportedSchemaError(
                f"json_schema: {path}: 'allOf' is supported only as the single keyword with one "
                "schema"
            )
        inner = self.rewrite(parts[0], f"{path}/allOf/0")
        return {**{k: v for k, v in node.items() if k in ("$defs", "definitions")}, **inner}

    def _type_union(self, node: dict[str, Any], kinds: list[str], path: str) -> dict[str, Any]:
        shared = {k: v for k, v in node.items() if k in _ANNOTATIONS}
        branches = []
        for kind in kinds:
            own = {k: v for k, v in node.items() if k in _TYPE_KEYWORDS.get(kind, set())}
            branches.append(self.rewrite({"type": kind, **own}, f"{path}/type/{kind}"))
        return {**shared, "anyOf": branches}

    def _object(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        properties = node.get("properties")
        if properties is None:
            if node.get("required"):
                raise UnsupportedSchemaError(
                    f"json_schema: {path}: 'required' without 'properties' is not supported"
                )
            extra = node.get("additionalProperties")
            if node.get("minProperties") or "maxProperties" in node:
                return self._bounded_map(node, path)
            if isinstance(extra, dict):
                node["additionalProperties"] = self.rewrite(extra, f"{path}/additionalProperties")
            return node
        required = list(node.get("required", []))
        missing = [name for name in required if name not in properties]
        if missing:
            raise UnsupportedSchemaError(
                f"json_schema: {path}: required property {missing[0]!r} is not in 'properties'"
            )
        too_few = node.get("minProperties", 0) > len(required)
        if too_few or node.get("maxProperties", math.inf) < len(properties):
            raise UnsupportedSchemaError(
                f"json_schema: {path}: 'minProperties'/'maxProperties' next to 'properties' is not "
                "supported"
            )
        rewritten = {}
        for name, sub in properties.items():
            if sub is False:
                if name in required:
                    raise UnsupportedSchemaError(
                        f"json_schema: {path}: required property {name!r} is false"
                    )
                continue
            rewritten[name] = self.rewrite(sub, f"{path}/properties/{name}")
        node["properties"] = rewritten
        node.pop("minProperties", None)
        node.pop("maxProperties", None)
        return node

    def _bounded_map(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        """A map (`additionalProperties`, no `properties`) with `minProperties` /
        `maxProperties`, which the builder ignores: its regex written here, each value through
        the builder."""
        extra = node.get("additionalProperties", True)
        low, high = node.get("minProperties", 0), node.get("maxProperties")
        if extra is False or self.value_regex is None or "$ref" in json.dumps(extra):
            raise UnsupportedSchemaError(
                f"json_schema: {path}: 'minProperties'/'maxProperties' on this map is not supported"
            )
        ws = self.whitespace
        value = self.value_regex({} if extra is True else extra)  # rewritten by its own pass
        entry = f"{JSON_STRING_REGEX}{ws}:{ws}(?:{value})"
        if high == 0:
            return self._placeholder(rf"\{{{ws}\}}")
        repeats = f"{{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        body = f"{entry}(?:{ws},{ws}{entry}){repeats}"
        return self._placeholder(rf"\{{{ws}{body if low else f'(?:{body})?'}{ws}\}}")

    def _array(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        items = node.get("items")
        if isinstance(items, list):
            raise UnsupportedSchemaError(
                f"json_schema: {path}: 'items' as a list; use 'prefixItems'"
            )
        if node.get("minItems", 0) > node.get("maxItems", math.inf):
            raise UnsupportedSchemaError(
                f"json_schema: {path}: 'minItems' is larger than 'maxItems'"
            )
        if "prefixItems" in node:
            count = len(node["prefixItems"])
            fits = node.get("minItems", 0) <= count <= node.get("maxItems", math.inf)
            if not fits or items not in (None, False):
                raise UnsupportedSchemaError(
                    f"json_schema: {path}: 'prefixItems' is supported only for fixed-length tuples"
                )
            node["prefixItems"] = [
                self.rewrite(s, f"{path}/prefixItems/{i}")
                for i, s in enumerate(node["prefixItems"])
            ]
            node.pop("items", None)
        elif items is not None:
            node["items"] = self.rewrite(items, f"{path}/items")
        return node

    def _bounds(self, node: dict[str, Any]) -> tuple[float | None, bool, float | None, bool]:
        low, high = node.get("minimum"), node.get("maximum")
        low_inclusive = high_inclusive = True
        exclusive_low, exclusive_high = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
        if exclusive_low is True or exclusive_high is True:  # draft 4 booleans
            low_inclusive, high_inclusive = exclusive_low is not True, exclusive_high is not True
        else:
            if isinstance(exclusive_low, (int, float)) and (low is None or exclusive_low >= low):
                low, low_inclusive = exclusive_low, False
            if isinstance(exclusive_high, (int, float)) and (
                high is None or exclusive_high <= high
            ):
                high, high_inclusive = exclusive_high, False
        return low, low_inclusive, high, high_inclusive

    def _integer(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        low, low_inclusive, high, high_inclusive = self._bounds(node)
        if low is None and high is None:
            return node
        if low is not None:
            low = math.ceil(low) if low_inclusive else math.floor(low) + 1
        if high is not None:
            high = math.floor(high) if high_inclusive else math.ceil(high) - 1
        try:
            return self._placeholder(integer_range_regex(low, high))  # type: ignore[arg-type]
        except ValueError as e:
            raise UnsupportedSchemaError(f"json_schema: {path}: {e}") from e

    def _number(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        low, low_inclusive, high, high_inclusive = self._bounds(node)
        if low is None and high is None:
            return node
        for bound in (low, high):
            if bound is not None and bound != int(bound):
                raise UnsupportedSchemaError(
                    f"json_schema: {path}: non-integer bound {bound} on a 'number' is not supported"
                )
        try:
            regex = number_range_regex(
                None if low is None else int(low),
                None if high is None else int(high),
                low_inclusive=low_inclusive,
                high_inclusive=high_inclusive,
            )
        except ValueError as e:
            raise UnsupportedSchemaError(f"json_schema: {path}: {e}") from e
        return self._placeholder(regex)

    def _string(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        used = [k for k in ("pattern", "format") if k in node]
        if "minLength" in node or "maxLength" in node:
            used.append("minLength/maxLength")
        if len(used) > 1:
            raise UnsupportedSchemaError(
                f"json_schema: {path}: {' together with '.join(used)} on one string is not "
                "supported"
            )
        if "format" in node:
            fmt = node["format"]
            if fmt not in FORMAT_REGEXES:
                raise UnsupportedSchemaError(
                    f"json_schema: {path}: string format {fmt!r} is not supported "
                    f"(supported: {', '.join(sorted(FORMAT_REGEXES))})"
                )
            return self._placeholder(FORMAT_REGEXES[fmt])
        if "pattern" in node:
            pattern = node["pattern"]
            try:
                re.compile(pattern)
            except re.error as e:
                raise InvalidSchemaError(
                    f"json_schema: {path}/pattern: invalid regex {pattern!r}: {e}"
                ) from e
            pattern = pattern[1:] if pattern.startswith("^") else pattern
            pattern = (
                pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
            )
            return self._placeholder(f'"(?:{ascii_classes(pattern)})"')
        return node
