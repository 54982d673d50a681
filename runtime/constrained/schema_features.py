"""What llguidance is handed for a JSON schema, and where a keyword sits in one.

`prepare_schema` copies the schema with changes that each keep every output valid (an output of
the copy validates against the original):
- **closed objects**: an object schema that lists `properties` and says nothing of others gets
  `additionalProperties: false`, as SGLang's and vLLM's grammar engines and OpenAI's strict mode
  do: the output has the declared properties only, instead of a model wandering into invented
  keys. Where object schemas are combined (`allOf`, `anyOf`/`oneOf` branches beside the
  object's own `properties`, a `$ref` beside them), llguidance intersects them, so each part is
  closed over the names of all the parts it meets (a name only one part declares gets `{}` in
  the others) and a shared definition over the names of every place that combines it. An
  object that is open somewhere (`patternProperties`, `additionalProperties` given as a schema,
  `unevaluatedProperties`, a `$ref` outside the document) stays open, with all it meets;
- a `format` the engine does not know is dropped: Draft 2020-12 makes an unknown format an
  annotation, not an assertion;
- over a closed set of properties, `minProperties` makes the first optional properties required
  and `maxProperties` leaves out the optional ones past it (the parser counts required ones only);
- `dependentRequired` (and `dependencies` given as lists) makes the properties it names
  required; `dependentSchemas` (and `dependencies` given as schemas) joins the schema to the
  object's `allOf` where the property is required, and forbids the property otherwise;
- `not` in the forms that say which properties or types are excluded (`{"required": [...]}`,
  `{"anyOf": [{"required": [...]}, ...]}`, `{"type": ...}`) becomes forbidden properties
  (`false`) or the remaining types; `{"not": {}}` becomes the `false` schema;
- `uniqueItems: true` on an array that may have fewer than two items becomes `maxItems: 1`
  (an array of at most one item is always unique). With `minItems` >= 2 it stays, and the
  engine rejects it by name;
- a `oneOf` whose branches provably exclude each other (`schema_disjoint.py`) becomes `anyOf`:
  any match is then the only one.
"""

from __future__ import annotations

from typing import Any

from .json_pointer import MISSING, escape, local_pointer, resolve
from .patterns import ascii_classes
from .schema_disjoint import relax_disjoint_one_of

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SCHEMA = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "additionalItems",
)
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COMBINED = ("allOf", "anyOf", "oneOf")
_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
_ANNOTATIONS = ("title", "description", "$comment", "examples", "default")

# Names: the property names an object schema may have, or OPEN when it admits others.
Names = frozenset
OPEN = None
_ROUNDS = 8  # passes over the document until what shared definitions meet stops growing


def prepare_schema(schema: Any, unknown_formats: set[str]) -> Any:
    prepared = _Preparer(schema, unknown_formats).run()
    return relax_disjoint_one_of(prepared)


class _Preparer:
    def __init__(self, root: Any, unknown_formats: set[str]) -> None:
        self.root = root
        self.unknown_formats = unknown_formats
        # JSON pointer of a `$ref` target -> the names of the places that combine it
        self.needs: dict[str, Names | None] = {}
        self._found: dict[str, Names | None] = {}
        self._names: dict[int, Names | None] = {}

    def run(self) -> Any:
        out = self.root
        for _ in range(_ROUNDS):
            self._found = {}
            out = self._walk(self.root, "#", Names())
            grown = _union_needs(self.needs, self._found)
            if grown == self.needs:
                return out
            self.needs = grown
        # NOTE: not settled (a cycle of definitions that keeps widening): leave them open
        self.needs = {pointer: OPEN for pointer in self.needs}
        return self._walk(self.root, "#", Names())

    # --- the copy -----------------------------------------------------------------------------

    def _walk(self, node: Any, path: str, ctx: Names | None) -> Any:
        if isinstance(node, list):  # `items` as a list (Draft 4-2019)
            return [self._walk(child, f"{path}/{i}", Names()) for i, child in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if _is_nothing(node):
            return False
        ctx = _meet(ctx, self.needs.get(path, Names()))
        node, forbidden = _local_rewrites(node)
        own = self._own_names(node)
        inner = OPEN if own is OPEN or ctx is OPEN else ctx | own
        out: dict[str, Any] = {}
        for key, value in node.items():
            where = f"{path}/{escape(key)}"
            if key == "format" and isinstance(value, str) and value in self.unknown_formats:
                continue
            if key in _SCHEMA:
                out[key] = self._walk(value, where, Names())
            elif key in _COMBINED and isinstance(value, list):
                out[key] = [self._walk(c, f"{where}/{i}", inner) for i, c in enumerate(value)]
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                out[key] = [self._walk(c, f"{where}/{i}", Names()) for i, c in enumerate(value)]
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                named = ascii_classes if key == "patternProperties" else str
                out[key] = {
                    named(k): self._walk(c, f"{where}/{escape(k)}", Names())
                    for k, c in value.items()
                }
            elif key == "pattern" and isinstance(value, str):
                out[key] = ascii_classes(value)
            else:
                out[key] = value
        if isinstance(node.get("$ref"), str):
            self._need(node["$ref"], inner)
            self._bare_ref(out)
        closed = self._close(node, out, ctx, own)
        if forbidden:
            properties = out.setdefault("properties", {})
            for name in forbidden:
                properties[name] = False
        if closed:
            _fix_property_counts(out)
        if out.get("uniqueItems") is True and _min_items(out) <= 1:
            del out["uniqueItems"]
            out["maxItems"] = min(out.get("maxItems", 1), 1)
        elif out.get("uniqueItems") is False:
            del out["uniqueItems"]
        return out

    def _close(self, node: dict, out: dict, ctx: Names | None, own: Names | None) -> bool:
        """Closes `out` over every name it may meet; False where it must stay open."""
        if out.get("additionalProperties") is False:
            return isinstance(out.get("properties"), dict)
        if ctx is OPEN or own is OPEN or not ("properties" in node or "allOf" in node):
            return False
        names = set(ctx | own)
        for key in ("anyOf", "oneOf"):
            for member in node.get(key, []) if isinstance(node.get(key), list) else []:
                found = self._names_of(member, frozenset())
                if found is OPEN:
                    return False
                names |= found
        if not names and "properties" not in node:
            return False
        properties = out.setdefault("properties", {})
        if not isinstance(properties, dict):
            return False
        for name in sorted(names - set(properties)):
            properties[name] = {}
        out["additionalProperties"] = False
        return True

    def _bare_ref(self, out: dict[str, Any]) -> None:
        """Drops what beside a `$ref` changes nothing: annotations, and a `type` its target
        already has (llguidance refuses siblings on a recursive reference)."""
        for key in (*_ANNOTATIONS, "$schema", "deprecated", "readOnly", "writeOnly"):
            out.pop(key, None)
        if "type" in out:
            pointer = local_pointer(out["$ref"])
            target = resolve(self.root, pointer) if pointer else MISSING
            mine, theirs = (
                _type_set(out["type"]),
                _type_set(target.get("type")) if isinstance(target, dict) else None,
            )
            if mine is not None and theirs is not None and theirs <= mine:
                del out["type"]

    def _need(self, ref: str, ctx: Names | None) -> None:
        pointer = local_pointer(ref)
        if pointer is None:
            return
        if pointer in self._found:
            self._found[pointer] = _join(self._found[pointer], ctx)
        else:
            self._found[pointer] = ctx

    # --- names --------------------------------------------------------------------------------

    def _own_names(self, node: dict) -> Names | None:
        """The names `node` itself declares, with those of what it is intersected with (its
        `allOf` members, a `$ref` beside them); OPEN where any of them admits others."""
        if _open_ended(node):
            return OPEN
        names = set(_declared(node))
        for member in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
            found = self._names_of(member, frozenset())
            if found is OPEN:
                return OPEN
            names |= found
        if "$ref" in node:
            found = self._ref_names(node["$ref"], frozenset())
            if found is OPEN:
                return OPEN
            names |= found
        return Names(names)

    def _names_of(self, node: Any, seen: frozenset[str]) -> Names | None:
        """The names an object of `node` may have (through its combinations); OPEN if unbounded."""
        if not isinstance(node, dict):
            return Names()
        # NOTE: cached whatever `seen` was: a name missed inside a cycle of definitions only
        # closes an object tighter, which may refuse a schema but never lets an invalid one out
        key = id(node)
        if key in self._names:
            return self._names[key]
        node, _ = _local_rewrites(node)
        if _open_ended(node):
            result: Names | None = OPEN
        else:
            names = set(_declared(node))
            result = Names(names)
            for combined in _COMBINED:
                for member in (
                    node.get(combined, []) if isinstance(node.get(combined), list) else []
                ):
                    found = self._names_of(member, seen)
                    if found is OPEN:
                        result = OPEN
                        break
                    names |= found
                if result is OPEN:
                    break
            if result is not OPEN and "$ref" in node:
                found = self._ref_names(node["$ref"], seen)
                result = OPEN if found is OPEN else Names(names | found)
            elif result is not OPEN:
                result = Names(names)
        self._names[key] = result
        return result

    def _ref_names(self, ref: Any, seen: frozenset[str]) -> Names | None:
        pointer = local_pointer(ref) if isinstance(ref, str) else None
        if pointer is None:
            return OPEN
        if pointer in seen:
            return Names()  # a recursive reference adds nothing new
        target = resolve(self.root, pointer)
        if target is MISSING:
            return OPEN
        return self._names_of(target, seen | {pointer})


def _local_rewrites(node: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Dependencies and the `not` forms as plainer keywords (a shallow copy), with the names
    of the properties that must not appear."""
    out = dict(node)
    required = (
        [r for r in out.get("required", []) if isinstance(r, str)]
        if isinstance(out.get("required"), list)
        else []
    )
    forbidden: list[str] = []
    for keyword in ("dependentRequired", "dependencies", "dependentSchemas"):
        value = out.get(keyword)
        if not isinstance(value, dict):
            continue
        kept = {}
        for name, need in value.items():
            if isinstance(need, list):  # "if `name` is present, so are these": all present
                for item in [name, *need]:
                    if isinstance(item, str) and item not in required:
                        required.append(item)
            elif isinstance(need, (dict, bool)) and name in required:
                out["allOf"] = [*(out.get("allOf") or []), need]
            elif isinstance(need, (dict, bool)):
                forbidden.append(name)  # never present, so the schema never applies
            else:
                kept[name] = need
        if kept:
            out[keyword] = kept
        else:
            del out[keyword]
    negated = out.get("not")
    if isinstance(negated, dict):
        excluded = _excluded_names(negated)
        if excluded is not None:
            optional = [n for n in excluded if n not in required]
            if optional:  # not all of them present: the first optional one never is
                forbidden.extend(optional if _every_name_excluded(negated) else optional[:1])
                del out["not"]
        elif set(negated) - set(_ANNOTATIONS) == {"type"}:
            types = _remaining_types(out.get("type"), negated["type"])
            if types is not None:
                out["type"] = types
                del out["not"]
    if required:
        out["required"] = required
    return out, forbidden


def _excluded_names(negated: dict) -> list[str] | None:
    """The names of `not: {"required": [...]}` or `not: {"anyOf": [{"required": [...]}...]}`."""
    keys = set(negated) - set(_ANNOTATIONS)
    if keys == {"required"} and isinstance(negated["required"], list) and negated["required"]:
        return [n for n in negated["required"] if isinstance(n, str)]
    if keys == {"anyOf"} and isinstance(negated["anyOf"], list) and negated["anyOf"]:
        names: list[str] = []
        for member in negated["anyOf"]:
            if not isinstance(member, dict) or set(member) - set(_ANNOTATIONS) != {"required"}:
                return None
            if not isinstance(member["required"], list) or len(member["required"]) != 1:
                return None
            names.extend(n for n in member["required"] if isinstance(n, str))
        return names
    return None


def _every_name_excluded(negated: dict) -> bool:
    """`not: {"anyOf": [{required: [a]}, {required: [b]}]}` excludes each name, while
    `not: {"required": [a, b]}` only excludes having all of them."""
    return "anyOf" in negated or len(negated.get("required", [])) == 1


def _remaining_types(declared: Any, excluded: Any) -> list[str] | None:
    excluded_set = (
        {excluded}
        if isinstance(excluded, str)
        else set(excluded)
        if isinstance(excluded, list)
        else None
    )
    if excluded_set is None or not excluded_set <= set(_TYPES):
        return None
    if declared is None:
        allowed = set(_TYPES) - {"integer"}  # "number" already holds the integers
    elif isinstance(declared, str):
        allowed = {declared}
    elif isinstance(declared, list):
        allowed = set(declared)
    else:
        return None
    if "number" in excluded_set:
        excluded_set.add("integer")
    if "integer" in excluded_set and "number" in allowed:
        allowed.discard("number")  # a number that is not an integer: no type says it
    types = [t for t in _TYPES if t in allowed and t not in excluded_set]
    return types or None


def _type_set(value: Any) -> set[str] | None:
    if isinstance(value, str):
        return {value, "integer"} if value == "number" else {value}
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return set(value) | ({"integer"} if "number" in value else set())
    return None


def _is_nothing(node: dict) -> bool:
    """`{"not": {}}` (or `{"not": true}`): no value validates."""
    negated = node.get("not")
    return (negated == {} or negated is True) and not set(node) - {"not", *_ANNOTATIONS}


def _open_ended(node: dict) -> bool:
    additional = node.get("additionalProperties")
    return (
        "patternProperties" in node
        or "unevaluatedProperties" in node
        or ("additionalProperties" in node and additional is not False)
    )


def _declared(node: dict) -> list[str]:
    names = list(node["properties"]) if isinstance(node.get("properties"), dict) else []
    required = node.get("required")
    if isinstance(required, list):
        names.extend(r for r in required if isinstance(r, str))
    return names


def _meet(ctx: Names | None, need: Names | None) -> Names | None:
    return OPEN if ctx is OPEN or need is OPEN else ctx | need


def _join(a: Names | None, b: Names | None) -> Names | None:
    return OPEN if a is OPEN or b is OPEN else a | b


def _union_needs(old: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
    out = dict(old)
    for pointer, names in found.items():
        out[pointer] = _join(out[pointer], names) if pointer in out else names
    return out


def _fix_property_counts(node: dict[str, Any]) -> None:
    """`minProperties` / `maxProperties` over a closed set of properties, as required ones: the
    first optional properties (in declared order) become required until the minimum holds, and
    optional properties past the maximum are left out."""
    names = [n for n, v in node["properties"].items() if v is not False]
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
            if name == "minProperties" or value >= len(names):
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
            name = f"{where}/{escape(key)}"
            if key in _SCHEMA:
                children.append((value, name))
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                children.extend((c, f"{name}/{i}") for i, c in enumerate(value))
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                children.extend((c, f"{name}/{escape(k)}") for k, c in value.items())
        stack.extend(reversed(children))
    return None
