"""Python functions as tools: a JSON schema from the signature and type hints, and a checked call.

The call format is the one many chat models are trained on (Hermes / Qwen style):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    function: Callable[..., Any]
    arguments: type[BaseModel]

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> ToolSpec:
        name = getattr(fn, "__name__", None)
        if not callable(fn) or not name or name == "<lambda>":
            raise ValueError(f"tools: expected named Python functions, got {fn!r}")
        try:
            hints = get_type_hints(fn)
        except Exception as e:  # unresolvable annotations
            raise ValueError(f"tools: cannot read the type hints of {name}: {e}") from None
        fields: dict[str, Any] = {}
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ValueError(f"tools: {name} takes *{p.name}; a tool needs named parameters")
            default = ... if p.default is p.empty else p.default
            fields[p.name] = (hints.get(p.name, Any), default)
        model = create_model(name, __config__=ConfigDict(extra="forbid"), **fields)
        doc = inspect.getdoc(fn) or ""
        return cls(
            name=name, description=doc.split("\n\n")[0].strip(), function=fn, arguments=model
        )

    def parameters_schema(self) -> dict[str, Any]:
        schema = self.arguments.model_json_schema()
        schema.pop("title", None)
        return schema

    def openai_schema(self) -> dict[str, Any]:
        """The tool as OpenAI-style chat templates expect it in `tools=`."""
        function = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters_schema(),
        }
        return {"type": "function", "function": function}

    def invoke(self, arguments: Any) -> Any:
        """Validate `arguments` against the signature, then call the function."""
        if not isinstance(arguments, dict):
            raise ValueError(
                f"{self.name}: arguments must be an object, got {type(arguments).__name__}"
            )
        try:
            checked = self.arguments.model_validate(arguments)
        except ValidationError as e:
            raise ValueError(f"{self.name}: invalid arguments: {e}") from None
        return self.function(**{k: getattr(checked, k) for k in type(checked).model_fields})


def tool_specs(tools: Sequence[Callable[..., Any]]) -> list[ToolSpec]:
    specs = [t if isinstance(t, ToolSpec) else ToolSpec.from_function(t) for t in tools]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: names must be unique, got {names}")
    return specs


def tool_call_schema(specs: Sequence[ToolSpec]) -> dict[str, Any]:
    """The JSON schema of one call to any of `specs`: {"name": const, "arguments": {...}}."""
    defs: dict[str, Any] = {}
    options = []
    for spec in specs:
        params = spec.parameters_schema()
        defs.update(params.pop("$defs", {}))
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": spec.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def describe_tools(tools: Sequence[Callable[..., Any]]) -> str:
    """A system-prompt paragraph that lists `tools` and the call format `gen(tools=)` expects."""
    lines = "\n".join(json.dumps(s.openai_schema()) for s in tool_specs(tools))
    return (
        "You can call these tools:\n<tools>\n" + lines + "\n</tools>\n"
        f'To call one, write {TOOL_CALL_OPEN}{{"name": <tool name>, "arguments": <object>}}'
        f"{TOOL_CALL_CLOSE}. Its result comes back in a tool message."
    )


def format_tool_result(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)
