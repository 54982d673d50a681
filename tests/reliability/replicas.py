"""Chaos with data parallelism: one of two replicas behind the cache-aware router is killed
(SIGKILL) mid-load. Non-streamed requests, and streams that had sent nothing yet, must be retried
on the survivor and complete; a stream that had started must end with an error event and
[DONE]. Afterwards the router reports the dead replica down in its routing table, `/health` and
`/metrics` (and the survivor up), sends it nothing more, and the survivor holds no KV pages, its
pool adds up and it answers /health_generate. Then the replica is started again on its port: the
router must route to it again once its health probe passes, and notice when it is killed once
more while idle (only the probe can tell then)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.reliability.report import Tally

BODY = {"max_new_tokens": 96, "ignore_eos": True, "temperature": 0}
NOTICE_S = 5.0  # how soon the router must see a replica go down or come back (probes every 0.2 s)


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
    free, cached, total = (
        _metric(text, k) for k in ("kv_pages_free", "kv_pages_cached", "kv_pages_total")
    )
    if in_use != 0:
        tally.leaks += 1
        tally.note(f"survivor: {in_use:.0f} KV pages still in use")
    if free + cached != total:
        tally.leaks += 1
        tally.note(f"survivor: free {free:.0f} + cached {cached:.0f} != total {total:.0f}")
    if httpx.get(url + "/health_generate", timeout=30).status_code != 200:
        tally.crashes += 1
        tally.note("survivor: /health_generate failed")


def _views(url: str, router: Any, replica: str) -> dict[str, bool]:
    """Whether each of the router's views has `replica` up: routing table, /health, /metrics."""
    entries = httpx.get(url + "/health", timeout=10).json()["replicas"]
    metrics = httpx.get(url + "/metrics", timeout=10).text
    up = re.search(
        rf'^plait_router_replica_up{{replica="{re.escape(replica)}"}} (\S+)$', metrics, re.M
    )
    return {
        "routing": any(r.url == replica for r in router.healthy()),
        "health": any(e["url"] == replica and e["healthy"] for e in entries),
        "metrics": up is not None and float(up.group(1)) == 1.0,
    }


def _await_views(tally: Tally, url: str, router: Any, replica: str, up: bool, what: str) -> None:
    """Waits up to NOTICE_S for every view to show `replica` up (or down); a crash if not."""
    began = time.monotonic()
    deadline = began + NOTICE_S
    while True:
        views = _views(url, router, replica)
        if all(v == up for v in views.values()):
            key = f"noticed_{what.replace(' ', '_')}_s"
            tally.extra[key] = round(time.monotonic() - began, 2)
            return
        if time.monotonic() > deadline:
            tally.crashes += 1
            wrong = ", ".join(k for k, v in views.items() if v != up)
            tally.note(
                f"{what}: after {NOTICE_S:.0f} s the router's {wrong} still show(s) "
                f"{replica} {'down' if up else 'up'}"
            )
            return
        time.sleep(0.05)


def _generate(tally: Tally, url: str, i: int) -> None:
    body = {"text": f"Check {i}: count", "sampling_params": {**BODY, "max_new_tokens": 4}}
    tally.sent += 1
    try:
        r = httpx.post(url + "/generate", json=body, timeout=120)
    except httpx.HTTPError as e:
        tally.lost += 1
        tally.note(f"check request {i}: {type(e).__name__}: {e}")
        return
    if r.status_code == 200:
        tally.completed += 1
    else:
        tally.lost += 1
        tally.note(f"check request {i}: HTTP {r.status_code} {r.text[:200]}")


def replica_death(
    model: str | Path, requests: int = 24, streams: int = 8, revive: bool = True
) -> Tally:
    from plait.server.data_parallel import start_replicas
    from plait.server.launch import ServerProcess, ServerThread
    from plait.server.router_app import create_router_app
    from plait.server.routing import Router, RouterConfig

    tally = Tally("chaos-replica-death")
    start = time.perf_counter()
    argv = [
        "--model",
        str(model),
        "--max-total-tokens",
        "8192",
        "--page-size",
        "4",
        "--log-level",
        "critical",
    ]
    procs = start_replicas(argv, 2, timeout=180)
    router = Router.for_urls([p.url for p in procs], RouterConfig(health_interval=0.2))
    for replica, proc in zip(router.replicas, procs):
        replica.process = proc
    app = create_router_app(router)
    victim, survivor = procs
    dead = router.replicas[0]
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
                body = {
                    "text": f"Stream {i}: count slowly",
                    "sampling_params": BODY,
                    "stream": True,
                }
                lines: list[str] = []
                try:
                    with httpx.stream(
                        "POST", server.url + "/generate", json=body, timeout=180
                    ) as r:
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
                # NOTE: kill it while it serves requests and a stream has started, or the run
                # would only test a replica that died idle.
                deadline = time.monotonic() + 60
                while not (started_streams.is_set() and dead.in_flight >= 2):
                    if time.monotonic() > deadline or all(f.done() for f in futures):
                        break
                    time.sleep(0.005)
                tally.extra["in_flight_at_kill"] = dead.in_flight
                os.kill(victim.process.pid, signal.SIGKILL)
                for f in futures:
                    f.result()
            _await_views(tally, server.url, router, victim.url, up=False, what="killed under load")
            _await_views(tally, server.url, router, survivor.url, up=True, what="the survivor")
            served = dead.served
            for i in range(4):
                _generate(tally, server.url, i)
            if dead.served != served:
                tally.crashes += 1
                tally.note(
                    f"the router still sent {dead.served - served} request(s) to the dead replica"
                )
            _survivor_leaks(tally, survivor.url)
            if revive:
                _revive_and_kill_idle(
                    tally, server.url, router, dead, victim, procs, ServerProcess, argv
                )
    finally:
        app.state.router.close()
        for p in procs:
            p.stop()
    tally.seconds = time.perf_counter() - start
    return tally


def _revive_and_kill_idle(
    tally: Tally,
    url: str,
    router: Any,
    dead: Any,
    victim: Any,
    procs: list,
    server_process: Any,
    argv: list[str],
) -> None:
    """The dead replica started again on its port, as an operator would behind `--replica URL`
    (the router did not start this process, so only its health probe can tell it is back)."""
    env = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}
    revived = server_process(argv, port=victim.port, timeout=180, env=env)
    procs.append(revived)
    dead.process = None
    _await_views(tally, url, router, victim.url, up=True, what="restarted")
    served = dead.served
    for i in range(4, 10):
        _generate(tally, url, i)
        if dead.served > served:
            break
    if dead.served == served:
        tally.crashes += 1
        tally.note("the restarted replica was healthy but the router sent it nothing")
    failures = dead.failures
    os.kill(revived.process.pid, signal.SIGKILL)
    revived.process.wait()
    _await_views(tally, url, router, victim.url, up=False, what="killed while idle")
    if dead.failures != failures + 1 or "ConnectError" not in (dead.last_error or ""):
        tally.note(
            f"killed while idle: {dead.failures - failures} failure(s), last {dead.last_error}"
        )
