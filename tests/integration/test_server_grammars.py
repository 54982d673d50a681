"""Grammars and budget-aware closing over HTTP: SGLang's `ebnf` on /generate, vLLM's
`structured_outputs` / `guided_*` fields through the real `openai` client, `closed_early`, and
the 400s that name the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.integration.server_support import tiny_server, wait_until_idle

PAREN = 'root ::= "(" root ")" | "x"'
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "tags"],
}
MESSAGES = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir, served_model_name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def balanced(text: str) -> bool:
    m = re.fullmatch(r"(\(*)x(\)*)", text)
    return bool(m) and len(m.group(1)) == len(m.group(2))


def test_generate_with_ebnf(server):
    body = {
        "text": "Nest:",
        "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "seed": 3, "ebnf": PAREN},
    }
    out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert balanced(out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"grammar": PAREN}},
        {"guided_grammar": PAREN},
        {"ebnf": 'start: "(" start ")" | "x"'},
    ],
)
def test_openai_grammar_fields(client, extra):
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=1, extra_body=extra
    )
    choice = resp.choices[0]
    if choice.finish_reason == "stop" or getattr(choice, "closed_early", False):
        assert balanced(choice.message.content), choice.message.content


@pytest.mark.parametrize(
    "extra,check",
    [
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
        ({"structured_outputs": {"regex": "[a-c]{2}"}}, lambda t: re.fullmatch("[a-c]{2}", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        (
            {"structured_outputs": {"json": SCHEMA}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
    ],
)
def test_openai_vllm_fields(client, extra, check):
    resp = client.completions.create(
        model="tiny", prompt="Answer:", max_tokens=64, temperature=0, extra_body=extra
    )
    assert check(resp.choices[0].text), resp.choices[0].text


def test_budget_closed_json_parses_and_says_so(server, client):
    """A tiny model writes long strings: at a small budget every output is closed early and
    still validates; finish_reason stays length."""
    closed = 0
    for seed in range(4):
        resp = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=24,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        )
        choice = resp.choices[0]
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        if choice.model_extra.get("closed_early"):
            assert choice.finish_reason == "length"
            closed += 1
        assert resp.usage.completion_tokens <= 24
    assert closed >= 1
    body = {
        "text": "{",
        "sampling_params": {
            "max_new_tokens": 20,
            "temperature": 1.0,
            "seed": 0,
            "json_schema": json.dumps({"type": "object"}),
        },
    }
    out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert isinstance(json.loads(out["text"]), dict)
    off = {**body, "sampling_params": {**body["sampling_params"], "budget_closing": False}}
    out = httpx.post(server.url + "/generate", json=off, timeout=60).json()
    assert out["meta_info"]["closed_early"] is False
    wait_until_idle(server.engine)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"guided_regex": "a", "guided_json": SCHEMA}, "guided_json"),
        ({"structured_outputs": {"grammar": "root ::= (("}}, None),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_bad_fields_are_400s_naming_them(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=8, extra_body=extra)
    error = info.value.body
    if param is not None:
        assert param in error["message"]
    wait_until_idle(server.engine)


def test_max_tokens_below_the_shortest_output_is_refused(server):
    schema = {
        "type": "object",
        "properties": {"a_long_property_name": {"type": "integer"}},
        "required": ["a_long_property_name"],
    }
    body = {
        "text": "x",
        "sampling_params": {"max_new_tokens": 2, "json_schema": json.dumps(schema)},
    }
    resp = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert resp.status_code == 400 and "max_new_tokens" in resp.json()["error"]["message"]
    wait_until_idle(server.engine)


def test_token_healing_flag(server, client):
    resp = client.completions.create(
        model="tiny",
        prompt="The capital of France is ",
        max_tokens=4,
        temperature=0,
        extra_body={"token_healing": True, "regex": "Paris"},
    )
    assert resp.choices[0].text == "Paris"
    body = {
        "text": "The capital of France is ",
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": 0,
            "token_healing": True,
            "regex": "Paris",
        },
    }
    out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert out["text"] == "Paris" and out["meta_info"]["healed_text"] == " "


SPACED = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "ok": {"type": "boolean"},
        "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
    },
    "required": ["n", "ok", "xs"],
    "additionalProperties": False,
}
SPACING = {
    "conventional": r'\{"n": -?\d+, "ok": (true|false), "xs": \[-?\d+, -?\d+\]\}',
    "compact": r'\{"n":-?\d+,"ok":(true|false),"xs":\[-?\d+,-?\d+\]\}',
}


@pytest.mark.parametrize("spacing", ["conventional", "compact", None])
def test_json_spacing_per_request(server, client, spacing):
    """`json_whitespace` per request on /generate and the OpenAI routes; conventional spacing
    when none is given."""
    expected = SPACING[spacing or "conventional"]
    params = {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(SPACED)}
    if spacing:
        params["json_whitespace"] = spacing
    out = httpx.post(
        f"{server.url}/generate", json={"text": "Data:", "sampling_params": params}, timeout=60
    )
    assert re.fullmatch(expected, out.json()["text"]), out.json()["text"]
    extra = {"json_whitespace": spacing} if spacing else {}
    chat = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=64,
        temperature=0,
        extra_body=extra,
        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": SPACED}},
    )
    assert re.fullmatch(expected, chat.choices[0].message.content), chat.choices[0].message.content


def test_bad_json_spacing_is_a_400_naming_it(server, client):
    params = {"max_new_tokens": 8, "json_schema": json.dumps(SPACED), "json_whitespace": "pretty"}
    out = httpx.post(
        f"{server.url}/generate", json={"text": "Data:", "sampling_params": params}, timeout=60
    )
    assert out.status_code == 400 and "json_whitespace" in out.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="json_whitespace"):
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=8,
            extra_body={"json_whitespace": "pretty"},
            response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": SPACED}},
        )
