"""Tool calling without a model: the plan per tool_choice, the forced-call schema, parsing calls
out of text, and the streaming filter."""

from __future__ import annotations

import json

import jsonschema
import pytest

from plait.server.errors import APIError
from plait.server.openai_protocol import ChatMessage, NamedToolChoice, Tool
from plait.server.tool_calls import (
    ToolStreamFilter,
    call_schema,
    parse_tool_calls,
    plan_tools,
    render_messages,
)

ADD = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
)
NOW = Tool.model_validate({"type": "function", "function": {"name": "now"}})


def test_plans():
    assert plan_tools(None, None, False).mode == "none"
    assert plan_tools([ADD], "none", False).mode == "none"
    auto = plan_tools([ADD, NOW], None, False)
    assert auto.mode == "auto" and auto.schema is None and not auto.forced
    required = plan_tools([ADD, NOW], "required", False)
    assert required.forced and required.prompt_suffix == "<tool_call>\n"
    named = plan_tools(
        [ADD, NOW], NamedToolChoice.model_validate({"function": {"name": "now"}}), True
    )
    assert named.mode == "named" and named.prompt_suffix == ""
    assert named.schema["properties"]["name"] == {"const": "now"}
    with pytest.raises(APIError):
        plan_tools(None, "required", False)


def test_call_schema_accepts_exactly_calls():
    schema = call_schema([ADD, NOW])
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)
    jsonschema.validate({"name": "now", "arguments": {}}, schema)
    for bad in (
        {"name": "add", "arguments": {"a": 1}},
        {"name": "sub", "arguments": {}},
        {"name": "now"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_parse_auto():
    plan = plan_tools([ADD, NOW], "auto", False)
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(text, plan)
    assert content == "Let me add."
    assert calls[0]["function"]["name"] == "add" and json.loads(
        calls[0]["function"]["arguments"]
    ) == {"a": 1, "b": 2}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    two = (
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
    )
    assert [c["function"]["name"] for c in parse_tool_calls(two, plan)[1]] == ["now", "add"]
    assert (
        parse_tool_calls('{"name": "now", "parameters": {}}', plan)[1][0]["function"]["name"]
        == "now"
    )
    for not_a_call in (
        "plain text",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        "<tool_call>{broken</tool_call>",
        '{"name": "add", "arguments": [1]}',
    ):
        assert parse_tool_calls(not_a_call, plan) == (not_a_call, [])


def test_parse_forced():
    plan = plan_tools([ADD, NOW], "required", False)
    content, calls = parse_tool_calls('{"name":"add","arguments":{"a":1,"b":2}}', plan)
    assert content is None and len(calls) == 1
    assert parse_tool_calls('{"name":"add","argu', plan) == ('{"name":"add","argu', [])


def test_stream_filter_holds_back_calls():
    plan = plan_tools([NOW], "auto", False)
    f = ToolStreamFilter()
    shown = ""
    text = 'Sure. <tool_call>{"name": "now", "arguments": {}}</tool_call>'
    for end in range(1, len(text) + 1):
        shown += f.feed(text[:end])
    assert shown == "Sure. "
    rest, calls = f.finish(plan)
    assert rest == "" and calls[0]["function"]["name"] == "now"
    g = ToolStreamFilter()
    assert g.feed("a <tool") == "a " and g.feed("a <tool is blunt") == "<tool is blunt"
    assert g.finish(plan) == ("", [])


def test_render_messages_without_tool_template():
    plan = plan_tools([ADD], "auto", False)
    msgs = [
        ChatMessage.model_validate(m)
        for m in [
            {"role": "developer", "content": "Be exact."},
            {"role": "user", "content": [{"type": "text", "text": "1+2?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a":1,"b":2}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ]
    ]
    out = render_messages(msgs, plan, template_renders_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be exact.") and '"name": "add"' in out[0]["content"]
    assert (
        out[2]["content"] == '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>"
    native = render_messages(msgs, plan, template_renders_tools=True)
    assert native[2]["tool_calls"][0]["function"]["name"] == "add" and native[3]["role"] == "tool"
