"""The program endpoint (programs registered from a file, listed, run, streamed) and the language's
examples running against the server through `plait.Endpoint`."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import httpx
import pytest

from tests.integration.server_support import sse_events, tiny_server, wait_until_idle

ROOT = Path(__file__).resolve().parents[2]

PROGRAMS = '''
from plait import assistant, gen, program, select, system, user


@program
def qa(s, question: str, max_words: int = 8):
    """Answer a question briefly."""
    s += system("Answer in a few words.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=max_words, temperature=0))


@program
def pick(s, topic):
    s += "Topic: " + topic + "\\nMood: "
    s += select("mood", choices=["happy", "sad", "calm"])
    s += "\\nWhy: " + gen("why", max_tokens=5, temperature=0)


@program
def broken(s):
    s += "Hi"
    s += gen("x", max_tokens=2)
    raise RuntimeError("this program always fails")
'''


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("programs") / "my_programs.py"
    path.write_text(textwrap.dedent(PROGRAMS))
    with tiny_server(tiny_llama_dir, programs=(str(path),)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_list_programs(client):
    listed = {p["name"]: p for p in client.get("/programs").json()["programs"]}
    assert sorted(listed) == ["broken", "pick", "qa"]
    assert listed["qa"]["doc"] == "Answer a question briefly."
    assert listed["qa"]["parameters"] == [
        {"name": "question", "required": True, "annotation": "str"},
        {"name": "max_words", "required": False, "default": 8, "annotation": "int"},
    ]


def test_run_returns_variables_and_text(server, client):
    r = client.post(
        "/programs/qa", json={"arguments": {"question": "Why is the sky blue?", "max_words": 4}}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    answer = out["variables"]["answer"]
    assert isinstance(answer, str) and answer in out["text"]
    assert [m["role"] for m in out["messages"]] == ["system", "user", "assistant"]
    again = client.post(
        "/programs/qa", json={"arguments": {"question": "Why is the sky blue?", "max_words": 4}}
    ).json()
    assert again["variables"] == out["variables"]  # greedy
    picked = client.post("/programs/pick", json={"arguments": {"topic": "rain"}}).json()
    assert picked["variables"]["mood"] in ("happy", "sad", "calm")
    wait_until_idle(server.engine)


def test_stream_events(client):
    body = {"arguments": {"question": "Hi?"}, "stream": True}
    with client.stream("POST", "/programs/qa", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    kinds = [e["event"] for e in events[:-1]]
    assert kinds[-1] == "done" and "text" in kinds
    assert kinds.index("variable_start") < kinds.index("variable_end")
    text = ""
    for e in events[:-1]:
        if e["event"] == "text":
            text = text[: e["offset"]] + e["text"]
    done = events[-2]
    assert text == done["text"]
    (end,) = [e for e in events[:-1] if e["event"] == "variable_end"]
    assert end["name"] == "answer" and end["value"] == done["variables"]["answer"]


def test_errors(client):
    r = client.post("/programs/nope", json={})
    assert r.status_code == 404 and "qa" in r.json()["error"]["message"]
    r = client.post("/programs/qa", json={"arguments": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "arguments"
    assert "question" in r.json()["error"]["message"]
    r = client.post("/programs/qa", json={"arguments": {"question": "x", "colour": 1}})
    assert r.status_code == 400
    r = client.post(
        "/programs/qa", json={"arguments": {"question": "x"}, "sampling": {"temprature": 1}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling"
    r = client.post("/programs/qa", json={"arguments": {"question": "x"}, "code": "import os"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "code"
    r = client.post("/programs/broken", json={})
    assert r.status_code == 500 and "always fails" in r.json()["error"]["message"]
    with client.stream("POST", "/programs/broken", json={"stream": True}) as s:
        events = sse_events(s.iter_lines())
    assert events[-2]["event"] == "error" and "always fails" in events[-2]["message"]
    assert client.get("/health").status_code == 200


def _example(name: str):
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", ROOT / "examples" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# json_extraction runs in tests/e2e/test_server_default_model.py: a random model never closes
# its strings.
@pytest.mark.parametrize(
    "name", ["fewshot_select", "multi_turn_chat", "tree_of_thought", "react_agent"]
)
def test_examples_run_through_endpoint(server, name, capsys):
    import plait

    endpoint = plait.Endpoint(server.url)
    result = _example(name).main(endpoint)
    assert result is not None
    wait_until_idle(server.engine)
