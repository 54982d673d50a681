"""Chaos with data parallelism: one of two replicas behind the cache-aware router is killed
(SIGKILL) mid-load. Non-streamed requests, and streams that had sent nothing yet, must be retried
on the survivor and complete; a stream that had started must end with an error event and
[DONE]. Afterwards the survivor holds no KV pages, its pool adds up, it answers
/health_generate, and the router reports the dead replica."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.reliability.report import Tally

BODY = {"max_new_tokens": 96, "ignore_eos": True, "temperature": 0}


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^plait_engine_{name} (\S+)$", text, flags=re.M)
    return float(match.group(1)) if match else float("nan")


def _survivor_leaks(tally: Tally, url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        in_use = _metric(text, "kv_pages_in_use")
        if in_use == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    free, cached, total = (_metric(text, k) for k in ("kv_pages_free", "kv_pages_cached", "kv_pages_total"))
    if in_use != 0:
        tally.leaks += 1
        tally.note(f"survivor: {in_use:.0f} KV pages still in use")
    if free + cached != total:
        tally.leaks += 1
        tally.note(f"survivor: free {free:.0f} + cached {cached:.0f} != total {total:.0f}")
    if httpx.get(url + "/health_generate", timeout=30).status_code != 200:
        tally.crashes += 1
        tally.note("survivor: /health_generate failed")


def replica_death(model: str | Path, requests: int = 24, streams: int = 8) -> Tally:
    from plait.server.data_parallel import start_replicas
    from plait.server.launch import ServerThread
    from plait.server.router_app import create_router_app
    from plait.server.routing import Router, RouterConfig

    tally = Tally("chaos-replica-death")
    start = time.perf_counter()
    argv = ["--model", str(model), "--max-total-tokens", "8192", "--page-size", "4", "--log-level", "critical"]
    procs = start_replicas(argv, 2, timeout=180)
    router = Router.for_urls([p.url for p in procs], RouterConfig(health_interval=0.2))
    for replica, proc in zip(router.replicas, procs):
        replica.process = proc
    app = create_router_app(router)
    victim = procs[0]
    try:
        with ServerThread(app, log_level="critical") as server:
            started_streams = threading.Event()

            def plain(i: int) -> None:
                body = {"text": f"Request {i}: count slowly", "sampling_params": BODY}
                try:
                    r = httpx.post(server.url + "/generate", json=body, timeout=180)
                except httpx.HTTPError as e:
                    tally.lost += 1
                    tally.note(f"request {i}: {type(e).__name__}")
                    return
                if r.status_code == 200:
                    tally.completed += 1
                else:  # nothing was streamed: the router must have retried it
                    tally.lost += 1
                    tally.note(f"request {i}: HTTP {r.status_code}")

            def streamed(i: int) -> None:
                body = {"text": f"Stream {i}: count slowly", "sampling_params": BODY, "stream": True}
                lines: list[str] = []
                try:
                    with httpx.stream("POST", server.url + "/generate", json=body, timeout=180) as r:
                        for line in r.iter_lines():
                            if line.startswith("data:"):
                                lines.append(line[5:].strip())
                                started_streams.set()
                except httpx.HTTPError as e:
                    tally.note(f"stream {i}: {type(e).__name__}")
                if not lines or lines[-1] != "[DONE]":
                    tally.lost += 1
                elif any('"error"' in line for line in lines):
                    tally.failed += 1  # cut by the replica's death: a clear error, then [DONE]
                else:
                    tally.completed += 1

            tally.sent = requests + streams
            with ThreadPoolExecutor(requests + streams) as pool:
                futures = [pool.submit(plain, i) for i in range(requests)]
                futures += [pool.submit(streamed, i) for i in range(streams)]
                started_streams.wait(60)
                time.sleep(0.3)
                os.kill(victim.process.pid, signal.SIGKILL)
                for f in futures:
                    f.result()
            health = httpx.get(server.url + "/health", timeout=10)
            if victim.url not in health.text:
                tally.note("the router's /health does not name the dead replica")
            dead = [r for r in router.replicas if not r.healthy]
            if len(dead) != 1:
                tally.crashes += 1
                tally.note(f"router reports {len(dead)} replicas down, expected 1")
            _survivor_leaks(tally, procs[1].url)
    finally:
        app.state.router.close()
        for p in procs:
            p.stop()
    tally.seconds = time.perf_counter() - start
    return tally
