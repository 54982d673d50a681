"""`gen(name, tools=[...])`: generate, and whenever the model opens a tool call, generate the
call under the tools' JSON schema, run the function, append its result, and continue.

One round: free text with `<tool_call>` as a stop string. If the model stopped there (and
calls remain), `<tool_call>` + a JSON call constrained to `{"name", "arguments"}` of one of the
tools + `</tool_call>` is appended, the function runs, and its result is appended as a `tool`
message (closing and reopening the open message, usually the assistant's), or inside
`<tool_response>` tags when no message is open. The variable gets the final round's text.
Tool errors (bad arguments, exceptions) are fed back to the model as the result.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from plait.interpreter.state_data import ToolCall
from plait.lang.ir import Gen
from plait.lang.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolSpec,
    format_tool_result,
    tool_call_schema,
)

if TYPE_CHECKING:
    from plait.interpreter.interpret import Interpreter


def run_tool_loop(interp: Interpreter, node: Gen) -> None:
    ex = interp.ex
    ex.backend.require("json_schema", needed_by=f"gen {node.name!r} with tools")
    sampling = node.sampling.over(ex.defaults)
    stops = tuple(sampling.stop or ())
    call_params = {
        **replace(sampling, stop=None).to_native(),
        "json_schema": json.dumps(tool_call_schema(node.tools)),
    }
    made = 0
    while True:
        can_call = made < node.max_tool_calls
        round_stops = stops + (TOOL_CALL_OPEN,) if can_call else stops
        params = replace(sampling, stop=round_stops or None).to_native()
        out = interp.generate(node.name, params)
        if not (can_call and out.finish_reason.get("matched") == TOOL_CALL_OPEN):
            break
        with ex.write() as d:
            d.append(TOOL_CALL_OPEN)
        call_text = interp.generate(None, call_params).text
        call = _execute(node.tools, call_text, node.name)
        made += 1
        result = format_tool_result(call.result if call.error is None else f"error: {call.error}")
        with ex.write() as d:
            d.append(TOOL_CALL_CLOSE)
            d.tool_calls.append(call)
            role = d.role
            if role is None:
                d.append(f"\n<tool_response>\n{result}\n</tool_response>\n")
            else:
                d.end_role(role, ex.template)
                d.begin_role("tool", ex.template)
                d.append(result)
                d.end_role("tool", ex.template)
                d.begin_role(role, ex.template)
    if node.name is not None:
        meta = {**out.meta_info, "tool_calls": made}
        with ex.write() as d:
            d.set_var(node.name, out.text, meta, out.text)


def _execute(tools: tuple[ToolSpec, ...], call_text: str, variable: str | None) -> ToolCall:
    try:
        call = json.loads(call_text)
        name, arguments = call["name"], call.get("arguments", {})
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return ToolCall(
            "?", call_text, error=f"the tool call is not valid JSON ({e})", variable=variable
        )
    spec = next((t for t in tools if t.name == name), None)
    if spec is None:
        known = ", ".join(t.name for t in tools)
        return ToolCall(
            str(name),
            arguments,
            error=f"no tool named {name!r} (tools: {known})",
            variable=variable,
        )
    try:
        result: Any = spec.invoke(arguments)
    except Exception as e:  # the model sees the error and may retry
        return ToolCall(name, arguments, error=f"{type(e).__name__}: {e}", variable=variable)
    return ToolCall(name, arguments, result=result, variable=variable)
