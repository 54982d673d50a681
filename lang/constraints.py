"""Constraint specifications: what `gen(regex=, json_schema=, dtype=)` asks of the backend.

A constraint lowers to one native sampling field (`regex`, or `json_schema` as a JSON string)
and knows how to read the generated text back into a Python value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

# dtype -> regex; bounded where possible, so greedy decoding terminates.
DTYPE_REGEX: dict[type, str] = {
    int: r"-?(0|[1-9][0-9]{0,17})",
    float: r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?",
    bool: r"(True|False)",
    str: r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"',
}


@dataclass(frozen=True)
class Constraint:
    """Exactly one of `regex` / `json_schema` / `grammar` is set; `dtype` or `model` say how to
    parse. `grammar` is a context-free grammar: GBNF / EBNF (`root ::= ...`) or Lark."""

    regex: str | None = None
    json_schema: str | None = None
    grammar: str | None = None
    dtype: type | None = None
    model: type[BaseModel] | None = None

    @classmethod
    def build(
        cls,
        regex: str | None = None,
        json_schema: Any = None,
        dtype: type | None = None,
        grammar: str | None = None,
    ) -> Constraint | None:
        given = [
            n
            for n, v in (
                ("regex", regex),
                ("json_schema", json_schema),
                ("dtype", dtype),
                ("grammar", grammar),
            )
            if v is not None
        ]
        if len(given) > 1:
            raise ValueError(
                "gen: pass at most one of regex, json_schema, dtype, grammar; "
                f"got {', '.join(given)}"
            )
        if grammar is not None:
            if not isinstance(grammar, str) or not grammar.strip():
                raise ValueError(f"grammar: expected a non-empty string, got {grammar!r}")
            return cls(grammar=grammar)
        if regex is not None:
            if not isinstance(regex, str) or not regex:
                raise ValueError(f"regex: expected a non-empty string, got {regex!r}")
            return cls(regex=regex)
        if dtype is not None:
            if dtype not in DTYPE_REGEX:
                raise ValueError(f"dtype: expected one of int, float, bool, str; got {dtype!r}")
            return cls(regex=DTYPE_REGEX[dtype], dtype=dtype)
        if json_schema is not None:
            return cls._from_schema(json_schema)
        return None

    @classmethod
    def _from_schema(cls, schema: Any) -> Constraint:
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return cls(json_schema=json.dumps(schema.model_json_schema()), model=schema)
        if isinstance(schema, dict):
            return cls(json_schema=json.dumps(schema))
        if isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema: not valid JSON ({e})") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"json_schema: must be a JSON object, got {type(parsed).__name__}")
            return cls(json_schema=schema)
        raise ValueError(
            "json_schema: expected a dict, a JSON string or a pydantic model class, "
            f"got {type(schema).__name__}"
        )

    def to_native(self) -> dict[str, str]:
        if self.grammar is not None:
            return {"ebnf": self.grammar}
        return (
            {"regex": self.regex}
            if self.regex is not None
            else {"json_schema": self.json_schema or ""}
        )

    def parse(self, text: str) -> Any:
        """The typed value of `text`; `ValueError` saying what was expected when it does not
        parse."""
        if self.dtype is not None:
            return _parse_dtype(self.dtype, text)
        if self.model is not None:
            try:
                return self.model.model_validate_json(text)
            except ValidationError as e:
                problems = "; ".join(
                    f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}"
                    for err in e.errors()
                )
                raise ValueError(f"not a valid {self.model.__name__} ({problems})") from None
        if self.json_schema is not None:
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e})") from None
        return text


def _parse_dtype(dtype: type, text: str) -> Any:
    stripped = text.strip()
    try:
        if dtype is bool:
            if stripped not in ("True", "False", "true", "false"):
                raise ValueError
            return stripped in ("True", "true")
        if dtype is str:
            return json.loads(stripped) if stripped.startswith('"') else text
        return dtype(stripped)
    except ValueError:
        raise ValueError(f"not a valid {dtype.__name__}: {text!r}") from None
