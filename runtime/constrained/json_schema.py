"""JSON schemas: normalisation (dict / JSON string / pydantic model -> JSON string), feature checks
and conversion to a regex with outlines-core's builder.

The builder silently ignores some keywords (numeric bounds, `uniqueItems`, `not`, ...) and emits
non-JSON for others (`allOf` with several schemas, control characters in its `email` format). A
rewrite pass runs first: it replaces what plait can express exactly (numeric bounds, string
formats, patterns) by placeholders that are substituted into the builder's regex afterwards, and
rejects what it cannot express with an `UnsupportedSchemaError` naming the keyword and where it is
(`schema_rewrite.py`).
"""

from __future__ import annotations

import json
from typing import Any

from .base import InvalidSchemaError, UnsupportedSchemaError
from .limits import DEFAULT_LIMITS, check_schema_shape
from .schema_rewrite import SchemaRewriter


def normalize_json_schema(schema: Any) -> str:
    """A dict, a JSON string or a pydantic model class -> the schema as compact JSON (key order
    kept)."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    elif isinstance(schema, (str, bytes)):
        if len(schema) > DEFAULT_LIMITS.max_text_chars:
            raise InvalidSchemaError(
                f"json_schema: {len(schema)} characters; the limit is "
                f"{DEFAULT_LIMITS.max_text_chars}"
            )
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidSchemaError(f"json_schema: not valid JSON: {e}") from e
        except RecursionError:
            schema = [[]] * (2 * DEFAULT_LIMITS.max_nesting + 1)  # too deep: rejected below
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidSchemaError(
            f"json_schema: expected a JSON object, a JSON string or a pydantic model class, got "
            f"{type(schema).__name__}"
        )
    check_schema_shape(schema)
    _check_against_metaschema(schema)
    out = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(out) > DEFAULT_LIMITS.max_text_chars:
        raise InvalidSchemaError(
            f"json_schema: {len(out)} characters as compact JSON; the limit is "
            f"{DEFAULT_LIMITS.max_text_chars}"
        )
    return out


def _check_against_metaschema(schema: dict[str, Any]) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "#" + "".join(f"/{p}" for p in e.path)
        raise InvalidSchemaError(f"json_schema: invalid schema at {where}: {e.message}") from e


def json_schema_to_regex(schema_json: str, whitespace_pattern: str = "") -> str:
    """The regex of every JSON text the schema accepts (in the builder's key order).

    `whitespace_pattern`: regex allowed between JSON tokens; "" is compact JSON.
    """
    from outlines_core.json_schema import build_regex_from_schema

    def value_regex(schema: Any) -> str:
        return json_schema_to_regex(json.dumps(schema), whitespace_pattern)

    rewriter = SchemaRewriter(whitespace_pattern, value_regex)
    rewritten = rewriter.rewrite(json.loads(schema_json), "#")
    try:
        regex = build_regex_from_schema(
            json.dumps(rewritten), whitespace_pattern=whitespace_pattern
        )
    except (ValueError, TypeError) as e:
        message = " ".join(str(e).split("\n")[0].split())
        raise UnsupportedSchemaError(f"json_schema: {message}") from e
    for placeholder, sub in rewriter.substitutions.items():
        regex = regex.replace(json.dumps(placeholder), f"(?:{sub})")
    return regex
