"""The OpenAI-compatible routes through the real `openai` client: chat, streaming with usage,
n, stop, logprobs, JSON-schema responses, tool calling, completions."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.integration.server_support import (
    CONSTRAINTS_PENDING,
    sse_events,
    tiny_server,
    wait_until_idle,
)

MESSAGES = [{"role": "user", "content": "Say something."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir, served_model_name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_chat_matches_the_chat_template(server, client):
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0
    )
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    prompt = server.engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    direct = server.engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0})
    assert choice.message.content == direct["text"]
    assert resp.usage.prompt_tokens == direct["meta_info"]["prompt_tokens"]
    assert resp.usage.completion_tokens == direct["meta_info"]["completion_tokens"]
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_with_usage(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_n_and_seed(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=5, n=2, seed=7, temperature=1.0)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 10
    streamed = list(client.chat.completions.create(**kwargs, stream=True))
    for i in (0, 1):
        text = "".join(
            c.choices[0].delta.content or ""
            for c in streamed
            if c.choices and c.choices[0].index == i
        )
        assert text == a.choices[i].message.content


def test_stop_string(client):
    full = client.completions.create(model="tiny", prompt="a b c", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[3:6]
    assert stop.strip(), text  # the random model's text is long enough to cut
    cut = client.completions.create(
        model="tiny", prompt="a b c", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_logprobs(server, client):
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.logprob - 1e-4  # greedy picked the top token
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token


def test_completions_echo_and_logprobs(client):
    resp = client.completions.create(
        model="tiny", prompt="one two", max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = resp.choices[0]
    assert choice.text.startswith("one two")
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == resp.usage.prompt_tokens + 3
    assert "".join(lp.tokens) == choice.text
    batch = client.completions.create(model="tiny", prompt=["a", "b c"], max_tokens=2, n=2)
    assert len(batch.choices) == 4 and batch.usage.completion_tokens == 8


@CONSTRAINTS_PENDING
def test_json_schema_response_is_valid(client):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, n=2, seed=1, response_format=fmt
    )
    for choice in resp.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # any object: the random model may never close a key, so only the start is certain here
    # (tests/e2e/test_server_default_model.py checks whole objects on a real model)
    obj = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, response_format={"type": "json_object"}
    )
    assert obj.choices[0].message.content.startswith("{")


@CONSTRAINTS_PENDING
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_call_gives_parseable_arguments(client, choice):
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What time is it in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=80,
        seed=2,
    )
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    call = calls[0]
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"][
        "parameters"
    ]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    # a conversation that carries the call and its result is accepted
    follow = client.chat.completions.create(
        model="tiny",
        max_tokens=4,
        tools=[WEATHER, TIME],
        messages=[
            {"role": "user", "content": "What time is it in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
        ],
    )
    assert follow.choices[0].message.role == "assistant"


@CONSTRAINTS_PENDING
def test_forced_tool_call_streamed(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_messages_and_tool_prompt(server, client):
    """Tools are rendered into the prompt; tool results and earlier calls are accepted."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    resp = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=3
    )
    with_tools = resp.usage.prompt_tokens
    none = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=3
    )
    assert with_tools > none.usage.prompt_tokens  # the tool list is in the first prompt only
    wait_until_idle(server.engine)


def test_streamed_completion_from_bursts_of_decode_steps(client, server):
    """Greedy decodes run in bursts of steps (num_continuous_decode_steps); a stream, whose
    tokens are handed on one by one, adds up to the text the same request gets whole."""
    kwargs = dict(
        model="tiny",
        prompt="one two three",
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    before = server.engine.stats()["total_burst_steps"]
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and whole.usage.completion_tokens == 40
    assert server.engine.stats()["total_burst_steps"] > before


def test_another_model_name_is_a_404_and_none_is_the_served_one(server, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-4o" in error["message"] and "tiny" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny-2", prompt="a", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    # `model` is optional on the wire: a request without it is for the served model
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    wait_until_idle(server.engine)


def test_the_default_name_is_the_folder_and_any_name_is_opt_in(tiny_llama_dir):
    with tiny_server(tiny_llama_dir) as srv:
        models = httpx.get(srv.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [tiny_llama_dir.name]
        assert httpx.get(srv.url + "/get_model_info").json()["model_path"] == str(tiny_llama_dir)
        r = httpx.post(
            srv.url + "/v1/completions", json={"model": "x", "prompt": "a", "max_tokens": 1}
        )
        assert r.status_code == 404
    with tiny_server(tiny_llama_dir, accept_any_model=True) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        reply = oai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
        assert reply.model == "gpt-4o" and reply.usage.completion_tokens >= 1


def test_default_name_of_a_gguf_file_is_its_stem():
    from plait.server.state import default_model_name

    assert default_model_name("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert default_model_name("/m/Qwen2.5-0.5B-Instruct/") == "Qwen2.5-0.5B-Instruct"


class Person(BaseModel):
    name: str
    age: int


CLOSED = dict(
    model="tiny",
    messages=[{"role": "user", "content": "A person, as JSON."}],
    max_tokens=24,
    temperature=0,
    response_format=Person,
)


def test_a_closed_output_parses_when_reported_as_stop(server, client):
    """Budget-aware closing finishes the JSON inside max_tokens; `finish_reason: length` makes
    the SDK's `.parse()` refuse it, `closed_finish_reason: stop` reports it parseable."""
    with pytest.raises(openai.LengthFinishReasonError) as caught:
        client.chat.completions.parse(**CLOSED)
    choice = caught.value.completion.choices[0]
    assert choice.model_extra["closed_early"] is True  # closed, not cut: the JSON is whole
    Person.model_validate_json(choice.message.content)
    reply = client.chat.completions.parse(**CLOSED, extra_body={"closed_finish_reason": "stop"})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["closed_early"] is True
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.content == caught.value.completion.choices[0].message.content
    wait_until_idle(server.engine)


def test_closed_finish_reason_per_server_and_on_generate(tiny_llama_dir):
    schema = json.dumps(Person.model_json_schema())
    native = {"text": "JSON:", "sampling_params": {"max_new_tokens": 24, "json_schema": schema}}
    with tiny_server(tiny_llama_dir, served_model_name="tiny", closed_finish_reason="stop") as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        reply = oai.chat.completions.parse(**CLOSED)
        assert (
            reply.choices[0].finish_reason == "stop"
            and reply.choices[0].model_extra["closed_early"]
        )
        with pytest.raises(openai.LengthFinishReasonError):  # a request's own choice wins
            oai.chat.completions.parse(**CLOSED, extra_body={"closed_finish_reason": "length"})
        meta = httpx.post(srv.url + "/generate", json=native, timeout=60).json()["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": None} and meta["closed_early"]
        stream = {**native, "stream": True}
        with httpx.stream("POST", srv.url + "/generate", json=stream, timeout=60) as r:
            events = sse_events(r.iter_lines())
        assert events[-2]["meta_info"]["finish_reason"]["type"] == "stop"
    with tiny_server(tiny_llama_dir) as srv:
        url = srv.url + "/generate"
        meta = httpx.post(url, json=native, timeout=60).json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["closed_early"]
        native["sampling_params"]["closed_finish_reason"] = "stop"
        meta = httpx.post(url, json=native, timeout=60).json()["meta_info"]
        assert meta["finish_reason"]["type"] == "stop" and meta["closed_early"]
        native["sampling_params"]["closed_finish_reason"] = "eos"
        r = httpx.post(url, json=native, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "closed_finish_reason"
