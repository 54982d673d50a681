"""Admission (503 + Retry-After when full), client disconnects freeing pages, and --api-key."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.integration.server_support import tiny_server, wait_until_idle

LONG = {"max_new_tokens": 900, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # 2 running + 1 queued: the fourth concurrent request is refused
    with tiny_server(
        tiny_llama_dir, {"max_running_requests": 2}, max_queue=1, api_key="sk-test"
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    headers = {"Authorization": "Bearer sk-test"}
    with httpx.Client(base_url=server.url, timeout=60, headers=headers) as c:
        yield c


def wait_running(engine, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["num_running"] + engine.stats()["num_waiting"] < count:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.005)


def test_api_key_required_except_health(server):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        assert anon.get("/health").status_code == 200
        for method, path in [
            ("GET", "/get_model_info"),
            ("POST", "/generate"),
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("GET", "/programs"),
            ("POST", "/flush_cache"),
        ]:
            r = anon.request(method, path, json={"text": "a"})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
        r = anon.get("/get_model_info", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "invalid" in r.json()["error"]["message"]
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    assert good.models.list().data


def test_stream_disconnect_aborts_and_frees_pages(server, client):
    engine = server.engine
    before = engine.stats()["total_generated_tokens"]
    body = {"text": "tell me a long story", "sampling_params": LONG, "stream": True}
    with client.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        seen = sum(1 for _, line in zip(range(6), lines) if line.startswith("data:"))
        assert seen >= 2
    # the response is closed: the request must stop well before its 900 tokens
    stats = wait_until_idle(engine)
    assert stats["total_generated_tokens"] - before < 900
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]


def test_non_streamed_disconnect_aborts(server):
    engine = server.engine
    before = engine.stats()["total_generated_tokens"]
    # 900 tokens of the tiny model take ~0.3 s here (continuous decode steps): leave well before
    with httpx.Client(
        base_url=server.url,
        timeout=httpx.Timeout(30, read=0.05),
        headers={"Authorization": "Bearer sk-test"},
    ) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/generate", json={"text": "wait for me", "sampling_params": LONG})
    stats = wait_until_idle(engine)
    assert stats["total_generated_tokens"] - before < 900


def test_queue_full_is_503_with_retry_after(server, client):
    engine = server.engine
    stop = threading.Event()
    streams = []

    def hold() -> None:
        body = {"text": "occupy", "sampling_params": LONG, "stream": True}
        with client.stream("POST", "/generate", json=body) as r:
            streams.append(r.status_code)
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    holders = [threading.Thread(target=hold) for _ in range(3)]
    for t in holders:
        t.start()
    try:
        wait_running(engine, 3)
        r = client.post(
            "/generate", json={"text": "one more", "sampling_params": {"max_new_tokens": 1}}
        )
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "capacity" in r.json()["error"]["message"]
        chat = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        )
        assert chat.status_code == 503
    finally:
        stop.set()
        for t in holders:
            t.join(timeout=30)
    assert streams == [200, 200, 200]
    wait_until_idle(engine)
    ok = client.post(
        "/generate", json={"text": "now there is room", "sampling_params": {"max_new_tokens": 1}}
    )
    assert ok.status_code == 200
