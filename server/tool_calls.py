"""Tool calling for the chat route: tools rendered into the prompt, tool calls parsed out of the
output, and the constraint that makes `tool_choice` "required" / a named function certain.

The call format is the Hermes / Qwen one that `plait.lang.tools` also uses:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A model whose chat template renders
`tools` itself gets them through its template; any other gets a system paragraph that lists
them, and its earlier calls and tool results are written into the conversation as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from plait.lang.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from plait.server.errors import bad_request
from plait.server.openai_protocol import ChatMessage, NamedToolChoice, Tool

_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S
)
_EMPTY_PARAMS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """What a chat request's tools change: the mode, the prompt and the constraint."""

    mode: str  # "none" (no tools in play), "auto", "required" or "named"
    tools: list[Tool] = field(default_factory=list)
    schema: dict[str, Any] | None = None  # the constraint on the output when a call is forced
    prompt_suffix: str = ""

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def plan_tools(tools: list[Tool] | None, choice: Any, template_renders_tools: bool) -> ToolPlan:
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: requires tools", "tool_choice")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request(f"tools: function names must be unique, got {names}", "tools")
    if choice == "none":
        return ToolPlan("none")
    if choice is None or choice == "auto":
        return ToolPlan("auto", list(tools))
    suffix = "" if template_renders_tools else TOOL_CALL_OPEN + "\n"
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise bad_request(
                f"tool_choice.function.name: {choice.function.name!r} is not one of the tools "
                f"({', '.join(names)})",
                "tool_choice.function.name",
            )
        return ToolPlan("named", list(tools), call_schema(chosen), suffix)
    return ToolPlan("required", list(tools), call_schema(tools), suffix)


def call_schema(tools: list[Tool]) -> dict[str, Any]:
    """One call to any of `tools`: `{"name": <const>, "arguments": <its parameters>}`."""
    options = []
    for tool in tools:
        params = tool.function.parameters or _EMPTY_PARAMS
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def tools_system_prompt(tools: list[Tool]) -> str:
    lines = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    return (
        "You can call these tools:\n<tools>\n" + lines + "\n</tools>\n"
        f'To call one, write {TOOL_CALL_OPEN}{{"name": <tool name>, "arguments": <object>}}'
        f"{TOOL_CALL_CLOSE}. Its result comes back in a <tool_response>."
    )


def render_messages(
    messages: list[ChatMessage], plan: ToolPlan, template_renders_tools: bool
) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (plain string contents)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if template_renders_tools:
            if m.tool_calls:
                msg["tool_calls"] = [
                    _call_dict(c.function.name, c.function.arguments, c.id) for c in m.tool_calls
                ]
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
        elif m.role == "assistant" and m.tool_calls:
            calls = [
                TOOL_CALL_OPEN
                + json.dumps(
                    {"name": c.function.name, "arguments": _args_obj(c.function.arguments)}
                )
                + TOOL_CALL_CLOSE
                for c in m.tool_calls
            ]
            msg["content"] = "\n".join([msg["content"], *calls]).strip()
        elif m.role == "tool":
            msg = {
                "role": "user",
                "content": f"<tool_response>\n{msg['content']}\n</tool_response>",
            }
        out.append(msg)
    if plan.mode != "none" and not template_renders_tools:
        text = tools_system_prompt(plan.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _args_obj(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _call_dict(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {
        "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _as_call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return _call_dict(obj["name"], args)


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) from a model's output. Arguments are always valid JSON objects;
    a block that does not parse, or names no known tool, stays in the content."""
    names = plan.names
    if plan.forced:
        try:
            call = _as_call(json.loads(text), names)
        except json.JSONDecodeError:
            call = None
        return (None, [call]) if call else (text or None, [])
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        try:
            parsed = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        found = [_as_call(o, names) for o in (parsed if isinstance(parsed, list) else [parsed])]
        if found and all(found):
            calls.extend(c for c in found if c)
            kept.append(text[pos : match.start()])
            pos = match.end()
    kept.append(text[pos:])
    if not calls:  # a bare JSON call, as tool-aware templates of some models ask for
        stripped = text.strip()
        if stripped.startswith(("{", "[")):
            try:
                parsed = json.loads(stripped)
            except json.JSONDecodeError:
                parsed = None
            found = [_as_call(o, names) for o in (parsed if isinstance(parsed, list) else [parsed])]
            if parsed is not None and found and all(found):
                return None, [c for c in found if c]
        return text, []
    content = "".join(kept).strip()
    return content or None, calls


class ToolStreamFilter:
    """For streamed `auto` tool choice: passes text through until a `<tool_call>` starts, then
    holds the rest so the calls can be parsed whole at the end."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.in_call = False

    def feed(self, text: str) -> str:
        """The cumulative text so far -> the new text that is safe to show as content."""
        self.text = text
        if self.in_call:
            return ""
        start = text.find(TOOL_CALL_OPEN, self.sent)
        if start >= 0:
            self.in_call = True
            safe = start
        else:
            safe = len(text)
            for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text) - self.sent), 0, -1):
                if TOOL_CALL_OPEN.startswith(text[len(text) - k :]):
                    safe = len(text) - k
                    break
        delta, self.sent = text[self.sent : safe], max(self.sent, safe)
        return delta

    def finish(self, plan: ToolPlan) -> tuple[str, list[dict[str, Any]]]:
        """The content not yet shown and the parsed calls."""
        _, calls = parse_tool_calls(self.text, plan)
        if not calls:
            return self.text[self.sent :], []
        return "", calls  # NOTE: text after the calls is dropped, as non-streamed parsing keeps it
