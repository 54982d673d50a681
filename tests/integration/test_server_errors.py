"""Bad input gets a 400 naming the field, and the server stays healthy afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.server_support import CONSTRAINTS_PENDING, tiny_server, wait_until_idle

SP = {"max_new_tokens": 2}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir, served_model_name="m") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


NATIVE = [
    ({"text": "a", "sampling_params": SP, "bogus": 1}, "bogus"),
    ({"sampling_params": SP}, "text"),
    ({"text": "a", "input_ids": [1], "sampling_params": SP}, "text"),
    ({"text": 5}, "text"),
    ({"text": []}, "text"),
    ({"input_ids": [1, "x"]}, "input_ids"),
    ({"input_ids": [10**7]}, "input_ids"),
    ({"input_ids": [5] * 1100}, "input_ids"),  # longer than the context (1024)
    ({"input_ids": [[]]}, "input_ids"),
    # the wrong JSON type where a list belongs: these were 500s (KeyError, TypeError)
    ({"input_ids": {"": None}, "text": None}, "input_ids"),
    ({"input_ids": {"": None}, "stream": True}, "input_ids"),
    ({"input_ids": 5}, "input_ids"),
    ({"input_ids": True}, "input_ids"),
    ({"text": {"a": 1}}, "text"),
    ({"text": [None]}, "text"),
    ({"text": ["a", 5]}, "text"),
    ({"text": "a", "sampling_params": [1]}, "sampling_params"),
    ({"text": "a", "sampling_params": {"stop": 5}}, "stop"),
    ({"text": "a", "sampling_params": {"stop": {"a": 1}}}, "stop"),
    ({"text": "a", "stream": True, "sampling_params": {"stop": True}}, "stop"),
    ({"text": "a", "sampling_params": {"stop_token_ids": 1.5}}, "stop_token_ids"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [10**30]}}, "stop_token_ids"),
    (
        {"text": "a", "sampling_params": {**SP, "stop_token_ids": [60000], "min_new_tokens": 1}},
        "stop_token_ids",
    ),
    ({"text": "a", "1 odd-key": 1}, "1 odd-key"),
    ({"text": "a", "": 1}, ""),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 10**9}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "a", "sampling_params": {"stop": [3]}}, "stop"),
    ({"text": "a", "sampling_params": {"n": 0}}, "n"),
    ({"text": "a", "sampling_params": {"colour": "red"}}, "sampling_params"),
    ({"text": "a", "sampling_params": "fast"}, "sampling_params"),
    ({"text": "a", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    (
        {"text": "a", "sampling_params": {"json_schema": '{"type": "object", "not": {}}'}},
        "json_schema",
    ),
    ({"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "constraint"),
    ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": -5}, "logprob_start_len"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "rid": 7}, "rid"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
    ({"text": "a", "image_data": "data:image/png;base64,AAAA"}, "image_data"),
]


@pytest.mark.parametrize(("body", "param"), NATIVE, ids=[p for _, p in NATIVE])
def test_native_bad_input(client, body, param):
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_max_new_tokens_past_the_context_is_a_400_naming_the_limit(server, client):
    context = server.engine.context_len  # 1024
    words = "word " * 900  # 900 tokens or so: counted, not guessed from its length
    refused = [
        {"text": "a", "sampling_params": {"max_new_tokens": 100_000}},
        {"text": words, "sampling_params": {"max_new_tokens": 200}},
        {"input_ids": [5] * 1000, "sampling_params": {"max_new_tokens": 25}},
        {"text": ["a", words], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 200}]},
        {"input_ids": [5] * 1000, "sampling_params": {"max_new_tokens": 25}, "stream": True},
    ]
    for body in refused:
        r = client.post("/generate", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "max_new_tokens", error
        assert f"context length ({context})" in error["message"], error
    fits = client.post(
        "/generate", json={"input_ids": [5] * 1000, "sampling_params": {"max_new_tokens": 24}}
    )
    assert fits.status_code == 200, fits.text
    r = client.post("/generate", json={"text": words, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    wait_until_idle(server.engine)


@CONSTRAINTS_PENDING
def test_invalid_regex_is_a_400(client):
    r = client.post("/generate", json={"text": "a", "sampling_params": {"regex": "(unclosed"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex"


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_invalid_regex_message_shows_where(tiny_llama_dir, backend):
    """The whole message, with the caret under the regex's faulty part and the reason."""
    with tiny_server(tiny_llama_dir, {"grammar_backend": backend}) as srv:
        body = {"text": "a", "sampling_params": {"max_new_tokens": 4, "regex": "ab{3,1}"}}
        r = httpx.post(srv.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("regex: ") and "ab{3,1}" in message
    assert "repetition count" in message or "repeat" in message, message  # the reason
    if "\n" in message:  # a caret line points under the repetition
        lines = message.splitlines()
        caret = next(i for i, line in enumerate(lines) if line.strip().startswith("^"))
        assert lines[caret - 1][lines[caret].index("^")] in "{3,1}", message


def test_lone_surrogates_are_a_400_naming_the_string(client):
    # valid JSON, but no Unicode text: it could neither be tokenized nor echoed in an error
    for raw, param in (
        (rb'{"text": "\ud800"}', "text"),
        (rb'{"text": ["a", "b\udfff"]}', "text.1"),
        (rb'{"text": "a", "sampling_params": {"stop": ["\udc00"]}}', "sampling_params.stop.0"),
        (rb'{"text": "a", "\ud800": 1}', "\\ud800"),
        (b'{"text": "\xed\xa0\x80"}', "text"),
    ):
        r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["param"] == param, r.json()
    chat = b'{"messages": [{"role": "user", "content": "\\udbff"}]}'
    r = client.post(
        "/v1/chat/completions", content=chat, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text
    emoji = rb'{"text": "\ud83d\ude00", "sampling_params": {"max_new_tokens": 1}}'  # a pair is fine
    r = client.post("/generate", content=emoji, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_abort_all_must_be_a_boolean(client):
    r = client.post("/abort_request", json={"abort_all": {"": None}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "abort_all", r.text
    assert (
        client.post("/abort_request", json={"rid": "nothing-runs", "abort_all": False}).status_code
        == 200
    )


def test_malformed_bodies(client):
    for raw in (b"{not json", b"", b"[1, 2]", b'"text"'):
        r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body", raw
    assert client.post("/v1/chat/completions", content=b"{").status_code == 400
    r = client.get("/no/such/route")
    assert r.status_code == 404 and "error" in r.json()


OPENAI = [
    ({"model": "m"}, "messages"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (
        {
            **CHAT,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        },
        "messages.0.content",
    ),
    ({**CHAT, "temperature": 5}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "max_tokens": -1}, "max_tokens"),
    ({**CHAT, "max_tokens": 5000}, "max_tokens"),
    ({**CHAT, "messages": [{"role": "user", "content": "word " * 1100}]}, "messages"),
    ({**CHAT, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({**CHAT, "frobnicate": True}, "frobnicate"),
    (
        {**CHAT, "Model": "m"},
        "Model",
    ),  # an unknown field's name is kept even if it looks like a type
    ({**CHAT, "logit_bias": {"1": 5}}, "logit_bias"),
    ({**CHAT, "stop": [1]}, "stop"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    (
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}},
            },
        },
        "response_format",
    ),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    (
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice.function.name",
    ),
    (
        {**CHAT, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        "tools.0.function.name",
    ),
    (
        {
            **CHAT,
            "tools": [
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "f"}},
            ],
        },
        "tools",
    ),
    (
        {
            **CHAT,
            "tool_choice": "sometimes",
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "tool_choice",
    ),
]


@pytest.mark.parametrize(
    ("body", "param"), OPENAI, ids=[f"{i}-{p}" for i, (_, p) in enumerate(OPENAI)]
)
def test_chat_bad_input(client, body, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


COMPLETIONS = [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10**8]}, "prompt"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "max_tokens": 2000}, "max_tokens"),
    ({"prompt": "a", "logprobs": 99}, "logprobs"),
    ({"prompt": {"text": "a"}}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), COMPLETIONS, ids=[p for _, p in COMPLETIONS])
def test_completions_bad_input(client, body, param):
    r = client.post("/v1/completions", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_healthy_after_bad_input(server, client):
    assert client.get("/health").status_code == 200
    out = client.post("/generate", json={"text": "still fine", "sampling_params": SP}).json()
    assert out["meta_info"]["completion_tokens"] == 2
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    wait_until_idle(server.engine)
    errors = [
        line
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("plait_request_errors_total")
    ]
    assert errors and any('status="400"' in line for line in errors)
