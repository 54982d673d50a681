"""A streaming client gets each token as its own server-sent event, on the native and the OpenAI
routes, counted (not timed) through a real server on loopback, while its decode steps run in
bursts (the kernel hands each step's tokens on between steps, `burst_streams.py`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.server_support import sse_events, tiny_server

TOKENS = 48


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir, served_model_name="tiny") as srv:
        srv.engine.generate("Warm up", {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True})
        assert srv.engine.stats()["total_burst_steps"] > 0, "decode steps burst"
        yield srv


def stream(server, path: str, body: dict) -> list:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        return sse_events(r.iter_lines())


def test_generate_streams_one_event_per_token(server):
    body = {
        "text": "Once upon a time",
        "stream": True,
        "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
    }
    bursts = server.engine.stats()["total_burst_steps"]
    events = stream(server, "/generate", body)
    assert events[-1] == "[DONE]"
    counts = [e["meta_info"]["completion_tokens"] for e in events[:-1]]
    assert counts == list(range(1, TOKENS + 1)), "each token its own event"
    assert server.engine.stats()["total_burst_steps"] > bursts, "the stream's steps ran in bursts"


def test_concurrent_streams_each_get_one_event_per_token(server):
    """Sixteen streams decoding in the same bursts: every token of each is its own event."""
    body = {
        "text": "Once upon a time",
        "stream": True,
        "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
    }
    with ThreadPoolExecutor(16) as pool:
        runs = list(
            pool.map(
                lambda i: stream(server, "/generate", {**body, "text": f"Story {i}:"}), range(16)
            )
        )
    for events in runs:
        counts = [e["meta_info"]["completion_tokens"] for e in events[:-1]]
        assert counts == list(range(1, TOKENS + 1))


def test_openai_completions_stream_one_chunk_per_token(server):
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = stream(server, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    chunks = [e for e in events[:-2] if e["choices"] and e["choices"][0]["text"]]
    # a token that ends inside a UTF-8 character adds no text: its chunk comes with the next
    assert len(chunks) >= 0.9 * usage["completion_tokens"], (len(chunks), usage)
