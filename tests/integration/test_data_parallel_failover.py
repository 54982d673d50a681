"""Killing a replica mid-load: requests that had not streamed are retried on the other one, a
stream that had started ends with an error naming the replica, and the router reports it gone.
(`plait serve --dp 2` itself runs in docs/scaling.md's example, tests/e2e/test_docs.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.server_support import sse_events

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tiny_llama_dir):
    from plait.server.data_parallel import start_replicas
    from plait.server.launch import ServerThread
    from plait.server.router_app import create_router_app
    from plait.server.routing import Router, RouterConfig

    argv = ["--model", str(tiny_llama_dir), "--max-total-tokens", "8192", "--page-size", "4",
            "--log-level", "warning"]  # fmt: skip
    procs = start_replicas(argv, 2, timeout=180)
    router = Router.for_urls([p.url for p in procs], RouterConfig(health_interval=0.2))
    for replica, proc in zip(router.replicas, procs):
        replica.process = proc
    app = create_router_app(router)
    try:
        with ServerThread(app) as server:
            server.router = router
            yield server
    finally:
        app.state.router.close()
        for p in procs:
            p.stop()


def _generate(url: str, i: int) -> httpx.Response:
    body = {"text": f"Request {i}: count slowly", "sampling_params": {
        "max_new_tokens": 96, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    return httpx.post(url + "/generate", json=body, timeout=120)


def _wait(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_killing_a_replica_loses_no_request_that_had_not_streamed(cluster):
    router = cluster.router
    stream_events: list = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"text": "A long story:", "stream": True,
                "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}  # fmt: skip
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
    retried = [line for line in metrics.splitlines()
               if line.startswith(f'plait_router_retries_total{{replica="{victim.url}"}}')]  # fmt: skip
    assert retried and float(retried[0].split()[-1]) >= 2
    assert _generate(cluster.url, 99).status_code == 200  # the survivor keeps serving

