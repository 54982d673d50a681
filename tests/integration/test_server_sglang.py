"""SGLang's own frontend (`sglang.RuntimeEndpoint`, sglang 0.5.2) runs unmodified programs
against plait: gen, streaming, select, fork, regex, batches."""

from __future__ import annotations

import re

import pytest

from tests.integration.server_support import CONSTRAINTS_PENDING, tiny_server, wait_until_idle

sgl = pytest.importorskip("sglang", reason="the SGLang frontend is not installed")


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    with tiny_server(tiny_llama_dir) as srv:
        endpoint = sgl.RuntimeEndpoint(srv.url)
        endpoint.server = srv
        yield endpoint


@sgl.function
def qa(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0))


@sgl.function
def choose(s, topic):
    s += "Topic: " + topic + "\nMood:"
    s += sgl.select("mood", choices=[" happy", " sad", " calm"])
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"\nIdea {i}:" + sgl.gen("idea", max_tokens=4, temperature=0)
    s += "\nIdeas: " + forks[0]["idea"] + " / " + forks[1]["idea"]


@sgl.function
def number(s):
    s += "A number: " + sgl.gen("n", max_tokens=6, regex=r"[0-9]{3}", temperature=0.7)


def test_gen_and_batch(backend):
    state = qa.run(question="Hi?", backend=backend)
    assert isinstance(state["answer"], str) and state["answer"]
    states = qa.run_batch([{"question": q} for q in ("a?", "b?", "c?")], backend=backend)
    assert all(s["answer"] for s in states)
    again = qa.run(question="Hi?", backend=backend)
    assert again["answer"] == state["answer"]


def test_stream(backend):
    state = qa.run(question="Stream?", backend=backend, stream=True)
    text = "".join(state.text_iter("answer"))
    assert text == state["answer"]


def test_select_and_fork(backend):
    state = choose.run(topic="rain", backend=backend)
    assert state["mood"] in ("happy", "sad", "calm", " happy", " sad", " calm")
    assert "Ideas:" in state.text()
    wait_until_idle(backend.server.engine)


@CONSTRAINTS_PENDING
def test_regex(backend):
    assert re.fullmatch(r"[0-9]{3}", number.run(backend=backend)["n"])
