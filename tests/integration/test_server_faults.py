"""Faults: an exception in one request's forward pass or grammar compile, deadlines, a storm of
client disconnects, KV pool exhaustion. After each, only the faulty request failed, the others
finished with the outputs they have alone, pages are all accounted for and the server is healthy.

Faults are injected by patching the engine's own objects (its runner's `forward`, its grammar
backend's `compile`), never through production flags.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import random
import threading
import time

import httpx
import pytest

from tests.integration.server_support import sse_events, tiny_server, wait_until_idle

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 600, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir, {"max_running_requests": 8}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@contextlib.contextmanager
def poisoned_forward(engine, marker: str = "poison"):
    real = engine.core.runner.forward

    def forward(batch, *args):
        if any(marker in e.req.rid for e in batch.extends) or any(
            marker in r.rid for r in batch.decodes
        ):
            raise RuntimeError("injected fault")
        return real(batch, *args)

    engine.core.runner.forward = forward
    try:
        yield
    finally:
        engine.core.runner.forward = real


def healthy(server, client) -> None:
    stats = wait_until_idle(server.engine)
    server.engine.core.scheduler.check()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert client.get("/health_generate").status_code == 200


def generate(client, text, rid=None, **extra):
    body = {"text": text, "sampling_params": GREEDY, **extra}
    if rid:
        body["rid"] = rid
    return client.post("/generate", json=body)


def test_forward_fault_fails_only_that_request(server, client):
    prompts = {f"r{i}": f"prompt number {i} says" for i in range(5)}
    alone = {rid: generate(client, p).json()["output_ids"] for rid, p in prompts.items()}
    with poisoned_forward(server.engine), concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = {rid: pool.submit(generate, client, p, rid) for rid, p in prompts.items()}
        futures["poison"] = pool.submit(generate, client, "poisoned prompt", "poison-1")
        results = {rid: f.result() for rid, f in futures.items()}
    bad = results.pop("poison")
    assert bad.status_code == 500 and "injected fault" in bad.json()["error"]["message"]
    for rid, r in results.items():
        assert r.status_code == 200 and r.json()["output_ids"] == alone[rid], rid
    healthy(server, client)


def test_stream_fault_ends_with_an_error_then_done(server, client):
    with poisoned_forward(server.engine):
        body = {"text": "x", "sampling_params": GREEDY, "stream": True, "rid": "poison-2"}
        with client.stream("POST", "/generate", json=body) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["finish_reason"]["status_code"] == 500
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "stream": True,
            "rid": "poison-3",
        }
        with client.stream("POST", "/v1/chat/completions", json=chat) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
    healthy(server, client)


def test_grammar_compile_fault_fails_only_that_request(server, client):
    backend = server.engine._grammar_cache().backend
    real = backend.compile

    def compile(key):
        if "poison" in key.pattern:
            raise RuntimeError("injected compile fault")
        return real(key)

    backend.compile = compile
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            bad = pool.submit(generate, client, "a", None, sampling_params={"regex": "poison[0-9]"})
            good = pool.submit(generate, client, "a", None, sampling_params={"regex": "[0-9]{3}"})
            bad, good = bad.result(), good.result()
    finally:
        backend.compile = real
    assert bad.status_code == 500 and "injected compile fault" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["text"].isdigit()
    healthy(server, client)


@contextlib.contextmanager
def slow_steps(engine, seconds: float = 0.1):
    """Every engine step outlasts `seconds` (a subscriber on the engine's thread): a deadline
    shorter than that expires inside the generation, however fast the model decodes."""
    from plait.runtime.events import StepFinished

    sub = engine.events.subscribe(lambda event: time.sleep(seconds), StepFinished)
    try:
        yield
    finally:
        sub.unsubscribe()


def test_deadlines_are_504(server, client):
    with slow_steps(server.engine):
        body = {"text": "x", "sampling_params": LONG, "timeout": 0.05}
        r = client.post("/generate", json=body)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        assert r.json()["error"]["param"] == "timeout"
        with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            events = sse_events(r.iter_lines())
        finish = events[-2]["meta_info"]["finish_reason"]
        assert events[-1] == "[DONE]" and finish["status_code"] == 504
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 900,
            "timeout": 0.05,
            "ignore_eos": True,
        }
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 504
    assert generate(client, "x", timeout=-1).json()["error"]["param"] == "timeout"
    healthy(server, client)


def test_disconnect_storm(server, client):
    rng = random.Random(0)
    engine = server.engine
    before = engine.stats()["total_generated_tokens"]

    def hang_up(i: int) -> None:
        body = {"text": f"story {i}", "sampling_params": LONG, "stream": i % 3 != 0}
        timeout = httpx.Timeout(30, read=rng.uniform(0.05, 0.4))
        with httpx.Client(base_url=server.url, timeout=timeout) as c:
            with contextlib.suppress(httpx.ReadTimeout):
                if not body["stream"]:
                    c.post("/generate", json=body)
                    return
                with c.stream("POST", "/generate", json=body) as r:
                    for _, _line in zip(range(rng.randint(0, 20)), r.iter_lines()):
                        pass

    threads = [threading.Thread(target=hang_up, args=(i,)) for i in range(60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stats = wait_until_idle(engine, timeout=30)
    assert stats["total_generated_tokens"] - before < 60 * 600 // 4  # they stopped early
    healthy(server, client)


def test_kv_pool_exhaustion_retracts_and_finishes_everything(tiny_llama_dir):
    sampling = {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}
    with tiny_server(tiny_llama_dir, {"max_total_tokens": 512}) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            body = {"text": [f"request {i} of many" for i in range(8)], "sampling_params": sampling}
            together = c.post("/generate", json=body).json()
            assert srv.engine.stats()["num_retracted"] > 0
            for i in (0, 7):
                alone = c.post(
                    "/generate", json={"text": f"request {i} of many", "sampling_params": sampling}
                ).json()
                assert alone["output_ids"] == together[i]["output_ids"]
            healthy(srv, c)


def test_a_batch_keeps_finished_results_when_one_fails(server, client):
    with poisoned_forward(server.engine):
        body = {
            "text": ["fine prompt", "another fine one"],
            "sampling_params": GREEDY,
            "rid": ["ok-a", "poison-4"],
        }
        r = client.post("/generate", json=body)
    assert r.status_code == 200
    ok, bad = r.json()
    assert ok["meta_info"]["finish_reason"]["type"] == "length" and len(ok["output_ids"]) == 12
    assert bad["meta_info"]["finish_reason"]["status_code"] == 500
    healthy(server, client)
