"""Chaos under prefill–decode disaggregation: a prefill or a decode replica (`plait serve --role
...` processes checking page accounting after every step) killed with SIGKILL while requests
are in flight on it. Nothing hangs; every request that had streamed nothing is served by what is
left, token for token as a colocated engine answers it; a stream that had started ends with an
error event naming the replica; the survivor holds no page."""

from __future__ import annotations

import os
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.server_support import routed, sse_events, wait_until

GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}


def _prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(100, 40000) for _ in range(600)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> dict[int, list[int]]:
    from plait import Engine

    with Engine(model_path=str(tiny_llama_dir), page_size=4, max_total_tokens=8192) as engine:
        outs = engine.generate(input_ids=[_prompt(i) for i in range(12)], sampling_params=GREEDY)
    return {i: o["output_ids"] for i, o in enumerate(outs)}


@pytest.fixture
def cluster(tiny_llama_dir):
    """Two decode replicas and a prefill replica behind the router."""
    from plait.server.data_parallel import start_replicas
    from plait.server.routing import Router, RouterConfig

    argv = [
        "--model",
        str(tiny_llama_dir),
        "--max-total-tokens",
        "8192",
        "--page-size",
        "4",
        "--check-invariants",
        "--log-level",
        "warning",
    ]
    procs = start_replicas(argv, 3, timeout=180, roles=["decode", "decode", "prefill"])
    urls = [p.url for p in procs]
    router = Router.for_urls(urls[:2], RouterConfig(health_interval=0.2), urls[2:])
    with routed(router, procs) as server:
        yield server


def _generate(url: str, i: int) -> httpx.Response:
    body = {"input_ids": _prompt(i), "sampling_params": GREEDY}
    return httpx.post(url + "/generate", json=body, timeout=120)


def _wait(condition, timeout: float = 60.0) -> None:
    wait_until(condition, timeout, interval=0.002)


def _engine_stat(url: str, key: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"plait_engine_{key} "):
            return float(line.split()[-1])
    raise AssertionError(f"plait_engine_{key} is not in {url}/metrics")


def _holds_nothing(url: str) -> None:
    _wait(lambda: _engine_stat(url, "kv_pages_in_use") == 0, timeout=20)
    _wait(lambda: _engine_stat(url, "kv_handoff_holds") == 0, timeout=20)


def _kill(replica) -> None:
    os.kill(replica.process.process.pid, signal.SIGKILL)
    replica.process.process.wait()


def _served(url: str, first: int, count: int, reference: dict[int, list[int]]) -> None:
    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(lambda i: _generate(url, i), range(first, first + count)))
    for i, r in enumerate(results, start=first):
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == reference[i]


def test_killed_replicas_cost_prefills_and_started_streams_not_requests(cluster, reference):
    first_decode, second_decode, prefill = cluster.router.replicas
    # 1. a decode replica killed mid-decode, with a stream and plain requests on it
    events: list[str] = []
    started, ended = threading.Event(), threading.Event()

    def stream() -> None:
        body = {
            "input_ids": _prompt(0)[:8],
            "stream": True,
            "sampling_params": {**GREEDY, "max_new_tokens": 1000},
        }
        with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                events.append(line)
                started.set()
        ended.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert started.wait(60)
    victim = next(r for r in (first_decode, second_decode) if r.in_flight == 1)
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(_generate, cluster.url, i) for i in range(12)]
        _wait(lambda: victim.in_flight >= 2)  # the stream and at least one more
        assert not ended.is_set(), "the stream finished before the kill"
        _kill(victim)
        results = [f.result(timeout=180) for f in futures]
    streamer.join(60)
    assert not streamer.is_alive()
    for i, r in enumerate(results):  # retried: prefilled again, pushed to the other replica
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == reference[i]
    parsed = sse_events(events)
    assert parsed[-1] == "[DONE]" and victim.url in parsed[-2]["error"]["message"]
    survivor = second_decode if victim is first_decode else first_decode
    assert not victim.healthy and survivor.healthy and prefill.healthy

    # 2. the prefill replica killed with prefill halves queued on it
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(_generate, cluster.url, i) for i in range(12)]
        _wait(lambda: prefill.in_flight >= 2)
        _kill(prefill)
        results = [f.result(timeout=180) for f in futures]
    for i, r in enumerate(results):  # prefilled where they decode
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == reference[i]
    assert not prefill.healthy and survivor.healthy
    metrics = httpx.get(cluster.url + "/metrics").text
    assert f'outcome="prefill_failed",replica="{prefill.url}"' in metrics
    _served(cluster.url, 0, 4, reference)
    _holds_nothing(survivor.url)
