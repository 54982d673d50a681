"""Killing a replica mid-load: requests that had not streamed are retried on the other one, a
stream that had started ends with an error naming the replica, and the router reports it gone.
Killed while idle, only the health probe can tell: the router must still mark it down, and route
to it again once it is back. (`plait serve --dp 2` itself runs in docs/scaling.md's example,
tests/e2e/test_docs.py.)"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.server_support import routed, sse_events, wait_until

pytestmark = pytest.mark.slow


def _argv(model_dir) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--max-total-tokens",
        "8192",
        "--page-size",
        "4",
        "--log-level",
        "warning",
    ]


@pytest.fixture
def cluster(tiny_llama_dir):
    from plait.server.data_parallel import start_replicas
    from plait.server.routing import Router, RouterConfig

    procs = start_replicas(_argv(tiny_llama_dir), 2, timeout=180)
    router = Router.for_urls([p.url for p in procs], RouterConfig(health_interval=0.2))
    with routed(router, procs) as server:
        yield server


def _generate(url: str, i: int) -> httpx.Response:
    body = {
        "text": f"Request {i}: count slowly",
        "sampling_params": {"max_new_tokens": 96, "ignore_eos": True, "temperature": 0},
    }
    return httpx.post(url + "/generate", json=body, timeout=120)


def _wait(condition, timeout: float = 30.0) -> None:
    wait_until(condition, timeout, interval=0.01)


def test_killing_a_replica_loses_no_request_that_had_not_streamed(cluster):
    router = cluster.router
    stream_events: list = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {
            "text": "A long story:",
            "stream": True,
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
        }
        with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                stream_events.append(line)
                first_chunk.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert first_chunk.wait(60)
    victim = next(r for r in router.replicas if r.in_flight == 1)
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(_generate, cluster.url, i) for i in range(12)]
        _wait(lambda: victim.in_flight >= 3)  # the stream and at least two plain requests
        os.kill(victim.process.process.pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    streamer.join(60)

    for r in results:
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 96
    events = sse_events(stream_events)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert victim.url in error["message"] and "not retried" in error["message"]

    health = httpx.get(cluster.url + "/health").json()
    assert health["status"] == "ok"
    gone = next(r for r in health["replicas"] if r["url"] == victim.url)
    assert gone["healthy"] is False and gone["last_error"]
    metrics = httpx.get(cluster.url + "/metrics").text
    assert f'plait_router_replica_up{{replica="{victim.url}"}} 0.0' in metrics
    retried = [
        line
        for line in metrics.splitlines()
        if line.startswith(f'plait_router_retries_total{{replica="{victim.url}"}}')
    ]
    assert retried and float(retried[0].split()[-1]) >= 2
    assert _generate(cluster.url, 99).status_code == 200  # the survivor keeps serving


def _replica_metric(url: str, name: str, replica: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'{name}{{replica="{replica}"}} '):
            return float(line.split()[-1])
    raise AssertionError(f"{name} for {replica} is not in /metrics")


def test_a_replica_that_dies_idle_is_marked_down_and_back_once_restarted(cluster, tiny_llama_dir):
    from plait.server.launch import ServerProcess

    router = cluster.router
    victim = router.replicas[0]
    assert _generate(cluster.url, 0).status_code == 200
    os.kill(victim.process.process.pid, signal.SIGKILL)
    victim.process.process.wait()
    _wait(lambda: not victim.healthy, timeout=5)  # no request went there: the probe saw it
    assert victim.last_error == "its process exited with code -9" and victim.downs == 1
    health = httpx.get(cluster.url + "/health").json()
    assert [r["healthy"] for r in health["replicas"]] == [False, True]
    assert _replica_metric(cluster.url, "plait_router_replica_up", victim.url) == 0.0
    assert _replica_metric(cluster.url, "plait_router_replica_downs_total", victim.url) == 1.0
    served = victim.served
    assert all(_generate(cluster.url, i).status_code == 200 for i in range(1, 4))
    assert victim.served == served  # traffic avoids it

    # restarted on its port, as behind `plait serve --replica URL`: back once its probe passes
    port = int(victim.url.rsplit(":", 1)[1])
    revived = ServerProcess(_argv(tiny_llama_dir), port=port, timeout=180)
    try:
        victim.process = None
        _wait(lambda: victim.healthy, timeout=5)
        assert _replica_metric(cluster.url, "plait_router_replica_up", victim.url) == 1.0
        for i in range(4, 10):
            assert _generate(cluster.url, i).status_code == 200
            if victim.served > served:
                break
        assert victim.served > served, "healthy again, but the router sent it nothing"
        os.kill(revived.process.pid, signal.SIGKILL)
        revived.process.wait()
        _wait(lambda: not victim.healthy, timeout=5)  # a refused probe, no forward needed
        assert "ConnectError" in victim.last_error and victim.downs == 2
    finally:
        revived.stop()
