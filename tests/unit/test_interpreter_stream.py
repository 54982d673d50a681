"""Streaming: `run(stream=True)` returns at once; `text_iter` yields text in order."""

from __future__ import annotations

import threading

import pytest

from plait.interpreter import MockBackend
from plait.lang import assistant, gen, program, user


@program
def story(s):
    s += user("Tell a story.")
    s += assistant(gen("story", max_tokens=32))
    s += user("Title?")
    s += assistant(gen("title", max_tokens=8))


def scripted(prompt: str, params: dict) -> str:
    return (
        "A Title" if prompt.count("<|im_start|>user") == 2 else "Once upon a time there was a fox."
    )


def test_stream_yields_the_whole_text_in_order():
    backend = MockBackend(scripted, stream_delay=0.01)
    state = story.run(backend=backend, stream=True)
    chunks = list(state.text_iter())
    assert len(chunks) > 5  # token by token, not one blob
    assert "".join(chunks) == state.text()
    assert all(c.stream for c in backend.calls)


def test_stream_one_variable():
    state = story.run(backend=MockBackend(scripted, stream_delay=0.01), stream=True)
    chunks = list(state.text_iter("story"))
    assert chunks[0] == "Once" and "".join(chunks) == "Once upon a time there was a fox."
    assert list(state.text_iter("title")) and state["title"] == "A Title"


def test_run_with_stream_returns_before_the_program_finishes():
    release = threading.Event()

    def slow(prompt: str, params: dict) -> str:
        release.wait(5)
        return "done"

    state = story.run(backend=MockBackend(slow), stream=True)
    assert state._executor.closed is False
    release.set()
    assert state["title"] == "done"


def test_without_stream_text_iter_gives_finished_text():
    state = story.run(backend=MockBackend(scripted))
    assert "".join(state.text_iter()) == state.text()
    assert list(state.text_iter("title")) == ["A Title"]


def test_backend_without_streaming_still_works_in_stream_mode():
    backend = MockBackend(scripted, features={"logprobs"})
    state = story.run(backend=backend, stream=True)
    assert "".join(state.text_iter()) == state.text()
    assert not any(c.stream for c in backend.calls)


def test_stream_reraises_the_program_error():
    @program
    def failing(s):
        s += "start " + gen("x")
        raise RuntimeError("boom")

    state = failing.run(backend=MockBackend("ok"), stream=True)
    with pytest.raises(RuntimeError, match="boom"):
        list(state.text_iter())
    assert isinstance(state.error, RuntimeError)
