"""`gen(tools=...)`: calls generated under the tools' schema, executed, results appended."""

from __future__ import annotations

import json

import pytest

from plait.interpreter import MockBackend, UnsupportedFeatureError
from plait.lang import assistant, describe_tools, gen, program, system, user


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def lookup(word: str) -> str:
    """Look a word up in the dictionary."""
    return {"plait": "a braid"}.get(word, "unknown")


@program
def agent(s, question, max_calls=3):
    s += system("Use tools when needed.\n" + describe_tools([add, lookup]))
    s += user(question)
    s += assistant(gen("answer", tools=[add, lookup], max_tool_calls=max_calls, max_tokens=64))


def scripted(*replies: str):
    return MockBackend(list(replies))


def test_tool_call_is_executed_and_the_model_continues():
    backend = scripted(
        "Let me add. <tool_call>",
        '{"name": "add", "arguments": {"a": 2, "b": 40}}',
        "The sum is 42.",
    )
    state = agent.run(question="2+40?", backend=backend)
    assert state["answer"] == "The sum is 42."
    (call,) = state.tool_calls
    assert (call.name, call.arguments, call.result, call.error) == (
        "add",
        {"a": 2, "b": 40},
        42,
        None,
    )
    assert [m["role"] for m in state.messages()] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert state.messages()[2]["content"] == (
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'
    )
    assert state.messages()[3]["content"] == "42"
    assert state.get_meta_info("answer")["tool_calls"] == 1
    first, second, third = backend.calls
    assert first.sampling_params["stop"] == ["<tool_call>"]
    schema = json.loads(second.sampling_params["json_schema"])
    assert {o["properties"]["name"]["const"] for o in schema["anyOf"]} == {"add", "lookup"}
    assert "stop" not in second.sampling_params
    assert third.text.endswith("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")


def test_no_tool_call_means_the_text_is_the_answer():
    state = agent.run(question="hi", backend=scripted("Hello!"))
    assert state["answer"] == "Hello!" and state.tool_calls == []


def test_max_tool_calls_ends_the_loop():
    backend = MockBackend(
        lambda prompt, params: (
            '{"name": "lookup", "arguments": {"word": "plait"}}'
            if "json_schema" in params
            else "again <tool_call>"
        )
    )
    state = agent.run(question="define plait", max_calls=2, backend=backend)
    assert [c.result for c in state.tool_calls] == ["a braid", "a braid"]
    assert "stop" not in backend.generate_calls[-1].sampling_params
    assert state["answer"] == "again <tool_call>"  # the last round may not call


def test_tool_errors_are_fed_back_to_the_model():
    backend = scripted(
        "<tool_call>",
        '{"name": "add", "arguments": {"a": "two", "b": 1}}',
        "<tool_call>",
        '{"name": "nope", "arguments": {}}',
        "Sorry.",
    )
    state = agent.run(question="?", backend=backend)
    bad_args, unknown = state.tool_calls
    assert "invalid arguments" in bad_args.error and bad_args.result is None
    assert "no tool named 'nope'" in unknown.error
    tool_messages = [m["content"] for m in state.messages() if m["role"] == "tool"]
    assert all(m.startswith("error: ") for m in tool_messages)


def test_tools_outside_a_message_use_response_tags():
    @program
    def plain(s):
        s += "Q: 1+1\nA: " + gen("a", tools=[add])

    backend = scripted("<tool_call>", '{"name": "add", "arguments": {"a": 1, "b": 1}}', "2")
    state = plain.run(backend=backend)
    assert state.text().endswith("</tool_call>\n<tool_response>\n2\n</tool_response>\n2")


def test_tools_need_json_schema_support():
    with pytest.raises(UnsupportedFeatureError, match="json_schema"):
        agent.run(question="?", backend=MockBackend(features={"logprobs"}))


def test_tools_in_forks_are_gathered_on_join():
    @program
    def p(s):
        forks = s.fork(2)
        forks += gen("a", tools=[add])
        forks.join()

    backend = MockBackend(
        lambda prompt, params: (
            '{"name": "add", "arguments": {"a": 1, "b": 2}}'
            if "json_schema" in params
            else ("done" if "</tool_call>" in prompt else "<tool_call>")
        )
    )
    state = p.run(backend=backend)
    assert [c.result for c in state.tool_calls] == [3, 3]
    assert state["a"] == ["done", "done"]
