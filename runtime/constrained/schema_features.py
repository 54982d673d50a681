"""What llguidance is handed for a JSON schema, and where a keyword sits in one.

`prepare_schema` copies the schema with five changes that keep every output valid:
- an object schema that lists `properties` and says nothing of others gets
  `additionalProperties: false`, as SGLang's and vLLM's grammar engines and OpenAI's strict mode
  do: the output has the declared properties only, instead of a model wandering into invented
  keys (members of an `allOf` keep theirs, since the merge would drop each other's properties);
- a `format` the engine does not know is dropped: Draft 2020-12 makes an unknown format an
  annotation, not an assertion;
- over a closed set of properties, `minProperties` makes the first optional properties required
  and `maxProperties` leaves out the optional ones past it (the parser counts required ones only);
- `dependentRequired` (and `dependencies` given as lists) makes the properties it names required;
- `uniqueItems: true` on an array that may have fewer than two items becomes `maxItems: 1`
  (an array of at most one item is always unique). With `minItems` >= 2 it stays, and the
  engine rejects it by name.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
           "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")  # fmt: skip
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


_OPEN_ENDED = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")


def prepare_schema(schema: Any, unknown_formats: set[str]) -> Any:
    return _walk(schema, unknown_formats, False)


def _walk(node: Any, unknown_formats: set[str], merged: bool) -> Any:
    if isinstance(node, list):  # `items` as a list (Draft 4-2019)
        return [_walk(child, unknown_formats, False) for child in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "format" and isinstance(value, str) and value in unknown_formats:
            continue
        if key in _SCHEMA:
            out[key] = _walk(value, unknown_formats, False)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_walk(child, unknown_formats, key == "allOf") for child in value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _walk(child, unknown_formats, False) for name, child in value.items()}
        else:
            out[key] = value
    if "properties" in out and not merged and not any(k in out for k in _OPEN_ENDED):
        out["additionalProperties"] = False
    _require_dependencies(out)
    if out.get("additionalProperties") is False and isinstance(out.get("properties"), dict):
        _fix_property_counts(out)
    if out.get("uniqueItems") is True and _min_items(out) <= 1:
        del out["uniqueItems"]
        out["maxItems"] = min(out.get("maxItems", 1), 1)
    elif out.get("uniqueItems") is False:
        del out["uniqueItems"]
    return out


def _require_dependencies(node: dict[str, Any]) -> None:
    """`dependentRequired` and the list form of `dependencies` ("if a is present, so is b"):
    every property named on either side becomes required, which satisfies them. Schema-valued
    dependencies stay (and are refused by name)."""
    for keyword in ("dependentRequired", "dependencies"):
        value = node.get(keyword)
        if not isinstance(value, dict) or not all(isinstance(v, list) for v in value.values()):
            continue
        required = list(node.get("required", []))
        for name, needs in value.items():
            for item in [name, *needs]:
                if isinstance(item, str) and item not in required:
                    required.append(item)
        node["required"] = required
        del node[keyword]


def _fix_property_counts(node: dict[str, Any]) -> None:
    """`minProperties` / `maxProperties` over a closed set of properties, as required ones: the
    first optional properties (in declared order) become required until the minimum holds, and
    optional properties past the maximum are left out."""
    names = list(node["properties"])
    required = [n for n in names if n in set(node.get("required", []))]
    low, high = node.get("minProperties"), node.get("maxProperties")
    if isinstance(low, int) and low > len(required):
        optional = [n for n in names if n not in required]
        required += optional[: low - len(required)]
        node["required"] = required
    if isinstance(high, int) and high < len(names) and high >= len(required):
        keep = set(required) | set([n for n in names if n not in required][: high - len(required)])
        node["properties"] = {n: v for n, v in node["properties"].items() if n in keep}
    for name in ("minProperties", "maxProperties"):
        value = node.get(name)
        if isinstance(value, int) and len(required) >= (value if name == "minProperties" else 0):
            if name == "minProperties" or value >= len(node["properties"]):
                node.pop(name)


def _min_items(node: dict[str, Any]) -> int:
    value = node.get("minItems", 0)
    return value if isinstance(value, int) else 0


def find_keyword(schema: Any, keyword: str) -> str | None:
    """The JSON pointer of the first schema (depth first) that uses `keyword`, or None."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((c, f"{where}/{i}") for i, c in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, dict):
            continue
        if keyword in node:
            return where
        children: list[tuple[Any, str]] = []
        for key, value in node.items():
            name = f"{where}/{_escape(key)}"
            if key in _SCHEMA:
                children.append((value, name))
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                children.extend((c, f"{name}/{i}") for i, c in enumerate(value))
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                children.extend((c, f"{name}/{_escape(k)}") for k, c in value.items())
        stack.extend(reversed(children))
    return None


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")
