"""On the embedded SmolLM2 model: docs/server.md runs top to bottom, and a real model under the
server's constraints gives schema-valid JSON, tool calls and the JSON-extraction example."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the served name: the default GGUF file's stem


def test_server_doc_examples_run(default_engine, monkeypatch):
    import plait

    # the doc builds its own Engine; hand it the shared fixture's to save a model load
    monkeypatch.setattr(plait, "Engine", lambda *a, **k: default_engine)
    monkeypatch.setattr(default_engine, "shutdown", lambda: None)
    blocks = re.findall(
        r"```python\n(.*?)```", (ROOT / "docs" / "server.md").read_text(), flags=re.S
    )
    assert len(blocks) >= 6
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/server.md (python block {i + 1})", "exec"), namespace)


@pytest.fixture(scope="module")
def server(default_engine):
    from plait.server.launch import serve_in_thread

    srv = serve_in_thread(default_engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_json_schema_chat(client):
    resp = client.chat.completions.create(
        model=MODEL,
        n=2,
        seed=0,
        max_tokens=64,
        messages=[
            {
                "role": "user",
                "content": "Maria is a 34-year-old architect in Lisbon. Give her as JSON.",
            }
        ],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        },
    )
    for choice in resp.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    obj = client.chat.completions.create(
        model=MODEL,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "A JSON object with your name."}],
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_tool_call_round_trip(client):
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        resp = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[tool],
            tool_choice=choice,
            max_tokens=48,
            temperature=0,
        )
        (call,) = resp.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_json_extraction_example_through_endpoint(server):
    import plait

    spec = importlib.util.spec_from_file_location(
        "example_json", ROOT / "examples" / "json_extraction.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    people = module.main(plait.Endpoint(server.url))
    assert len(people) == 2 and all(p.age > 0 for p in people)
