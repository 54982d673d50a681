"""A streaming client gets each token as its own server-sent event, on the native and the OpenAI
routes, counted (not timed) through a real server on loopback.

NOTE: whether a stream's decode steps run as a watched burst (`burst_streams.py`) or one by one
depends on how long a step takes; these tests fix it to one by one, so the count does not depend
on the machine's load. The watched bursts' own deliveries are checked in
`tests/unit/test_burst_streams.py` and `test_decode_burst.py`."""

from __future__ import annotations

import httpx
import pytest

from plait.runtime import bursts
from tests.integration.server_support import sse_events, tiny_server

TOKENS = 48


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with (
        pytest.MonkeyPatch.context() as patch,
        tiny_server(tiny_llama_dir, served_model_name="tiny") as srv,
    ):
        patch.setattr(bursts, "STREAM_BURST_MIN_STEP_SECONDS", float("inf"))
        srv.engine.generate("Warm up", {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True})
        assert srv.engine.stats()["total_burst_steps"] > 0, "requests that are not streamed burst"
        yield srv


def stream(server, path: str, body: dict) -> list:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        return sse_events(r.iter_lines())


def test_generate_streams_one_event_per_token(server):
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    events = stream(server, "/generate", body)
    assert events[-1] == "[DONE]"
    counts = [e["meta_info"]["completion_tokens"] for e in events[:-1]]
    assert counts == list(range(1, TOKENS + 1)), "each token its own event"


def test_openai_completions_stream_one_chunk_per_token(server):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events = stream(server, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    chunks = [e for e in events[:-2] if e["choices"] and e["choices"][0]["text"]]
    # a token that ends inside a UTF-8 character adds no text: its chunk comes with the next
    assert len(chunks) >= 0.9 * usage["completion_tokens"], (len(chunks), usage)
