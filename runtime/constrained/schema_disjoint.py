"""Which `oneOf` branches provably exclude each other, so that `anyOf` says the same.

llguidance refuses a `oneOf` unless its branches differ by type: an Earley parser cannot check
"exactly one". Most real `oneOf`s are discriminated unions (pydantic's tagged unions, OpenAPI's
`discriminator`): the branches require a property whose `const` / `enum` values differ, or one
branch requires a property another forbids. For those, any value that matches a branch matches
no other, and the `oneOf` is relaxed to `anyOf`. The proof is conservative: a pair it cannot
decide keeps the `oneOf` (and the engine refuses it by name).
"""

from __future__ import annotations

import json
from typing import Any

from .json_pointer import MISSING, local_pointer, resolve

_DEPTH = 8  # `$ref` hops followed while proving two branches apart
_NUMBERS = ("number", "integer")
_ALL_TYPES = frozenset(("null", "boolean", "object", "array", "number", "integer", "string"))


def relax_disjoint_one_of(schema: Any) -> Any:
    """`schema` with each `oneOf` of pairwise disjoint branches spelled `anyOf` (in place on the
    prepared copy, which no caller shares)."""
    stack = [schema]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        branches = node.get("oneOf")
        if (
            isinstance(branches, list)
            and "anyOf" not in node
            and _pairwise_disjoint(schema, branches)
        ):
            node["anyOf"] = node.pop("oneOf")
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return schema


def _pairwise_disjoint(root: Any, branches: list[Any]) -> bool:
    if len(branches) < 2:
        return True
    return all(
        disjoint(root, a, b, _DEPTH) for i, a in enumerate(branches) for b in branches[i + 1 :]
    )


def disjoint(root: Any, a: Any, b: Any, depth: int) -> bool:
    """True only if no JSON value validates against both `a` and `b`."""
    if depth <= 0:
        return False
    a, b = _deref(root, a), _deref(root, b)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    for side, other in ((a, b), (b, a)):  # a union is apart from `other` if every member is
        members = side.get("anyOf") or side.get("oneOf")
        if (
            isinstance(members, list)
            and members
            and all(disjoint(root, m, other, depth - 1) for m in members)
        ):
            return True
        for conjunct in side.get("allOf", []) if isinstance(side.get("allOf"), list) else []:
            if disjoint(root, conjunct, other, depth - 1):
                return True
        if "$ref" in side and disjoint(root, {"$ref": side["$ref"]}, other, depth - 1):
            return True
    values_a, values_b = _values(a), _values(b)
    types_a, types_b = _types(a), _types(b)
    if values_a is not None and values_b is not None:
        return not (values_a & values_b)
    if values_a is not None and types_b is not None:
        return not any(_value_type_in(v, types_b) for v in values_a)
    if values_b is not None and types_a is not None:
        return not any(_value_type_in(v, types_a) for v in values_b)
    if types_a is not None and types_b is not None and not _types_meet(types_a, types_b):
        return True
    # `required` and `properties` say nothing of non-objects: one side must allow objects only
    if types_a != frozenset(("object",)) and types_b != frozenset(("object",)):
        return False
    return _objects_apart(root, a, b, depth)


def _objects_apart(root: Any, a: dict, b: dict, depth: int) -> bool:
    """Two object schemas apart by one property: required by one and forbidden by the other,
    or required by one with values the other's schema for it excludes."""
    for side, other in ((a, b), (b, a)):
        required = side.get("required")
        if not isinstance(required, list):
            continue
        for name in required:
            if not isinstance(name, str):
                continue
            theirs = _property_schema(other, name)
            if theirs is False:
                return True
            mine = _property_schema(side, name)
            if mine is not None and theirs is not None and disjoint(root, mine, theirs, depth - 1):
                return True
    return False


def _property_schema(node: dict, name: str) -> Any:
    """The schema `node` gives property `name`: False where it is forbidden, None if unknown."""
    properties = node.get("properties")
    if isinstance(properties, dict) and name in properties:
        return properties[name]
    if node.get("additionalProperties") is False and "patternProperties" not in node:
        return False
    return None


def _deref(root: Any, node: Any) -> Any:
    for _ in range(_DEPTH):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)):
            return node
        if set(node) - {"$ref", "title", "description", "$comment"}:
            return node  # a `$ref` with siblings: judged by the siblings, and the ref as a conjunct
        target = _lookup(root, node["$ref"])
        if target is None:
            return node
        node = target
    return node


def _lookup(root: Any, ref: str) -> Any:
    pointer = local_pointer(ref)
    target = MISSING if pointer is None else resolve(root, pointer)
    return None if target is MISSING else target


def _values(node: dict) -> set[str] | None:
    """The values `node` allows, canonically spelled, when it lists them (`const`, `enum`)."""
    if "const" in node:
        candidates = [node["const"]]
    elif isinstance(node.get("enum"), list):
        candidates = node["enum"]
    else:
        return None
    return {_canonical(v) for v in candidates}


def _canonical(value: Any) -> str:
    """JSON Schema equality: 1 and 1.0 are the same number; true is not 1."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, dict):
        return (
            "{"
            + ",".join(f"{json.dumps(k)}:{_canonical(v)}" for k, v in sorted(value.items()))
            + "}"
        )
    if isinstance(value, list):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    return json.dumps(value)


def _types(node: dict) -> frozenset[str] | None:
    declared = node.get("type")
    if isinstance(declared, str):
        return frozenset((declared,)) & _ALL_TYPES or None
    if isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        return frozenset(declared) & _ALL_TYPES or None
    return None


def _types_meet(a: frozenset[str], b: frozenset[str]) -> bool:
    if a & b:
        return True
    return ("number" in a and "integer" in b) or ("integer" in a and "number" in b)


def _value_type_in(canonical: str, types: frozenset[str]) -> bool:
    value = json.loads(canonical)
    if value is None:
        kind = "null"
    elif isinstance(value, bool):
        kind = "boolean"
    elif isinstance(value, int):
        return bool(types & set(_NUMBERS))
    elif isinstance(value, float):
        kind = "number"
    elif isinstance(value, str):
        kind = "string"
    elif isinstance(value, list):
        kind = "array"
    else:
        kind = "object"
    return kind in types
