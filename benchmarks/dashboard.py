"""`plait bench dashboard`: what watching `/dashboard` costs a decode step.

The same batch of decode-only requests (`--concurrency` streams of `--output-len` tokens, one
shared prompt) runs in alternating rounds: nobody watching (the engine probe off), then a watcher
polling `/dashboard/snapshot` at each `--poll-hz` (1 Hz is what the page does; faster rates show
the trend). A round's figures are its wall time and this process's CPU time over the engine's
decode steps (the watcher runs in another process; CPU time is steadier than wall time on a shared
machine).
Also reported: how long one snapshot takes to build on the server's event loop, and the probe's
own cost per step on a fake batch (no model), so the two parts of the cost are seen apart.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from typing import Any

from plait.benchmarks.common import print_table, write_json


def add_dashboard_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=8, help="requests decoded together")
    parser.add_argument(
        "--output-len", dest="output_len", type=int, default=256, help="tokens per request"
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per mode")
    parser.add_argument("--poll-hz", dest="poll_hz", default="1,10", help="comma-separated rates")
    parser.add_argument(
        "--output", default="bench-results/dashboard.json", help="JSON file of the results"
    )


@contextmanager
def watching(url: str, hz: float, latencies: list[float]) -> Iterator[None]:
    """A client in another process (its own work is not the server's cost) polling the snapshot
    like the page does, incrementally with `since`; its request times land in `latencies`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait.benchmarks.dashboard", url, str(hz)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        latencies.extend(float(line) for line in out.split())


def poll(url: str, hz: float) -> None:
    """Polls until terminated, printing each request's seconds."""
    import httpx

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    since = None
    with httpx.Client(base_url=url, timeout=30) as http:
        while True:
            start = time.perf_counter()
            rows = http.get("/dashboard/snapshot", params={} if since is None else {"since": since})
            print(time.perf_counter() - start, flush=True)
            history = rows.json()["history"]
            since = history[-1]["seq"] if history else since
            time.sleep(max(1.0 / hz - (time.perf_counter() - start), 0.0))


def probe_cost_us(batch_size: int, repeats: int = 20000) -> float:
    """Microseconds the subscribed probe adds to one step of a decode batch: the step's events
    (`StepFinished`, and the check for it with nobody subscribed) without a model."""
    from plait.runtime.events import EngineEvents, StepFinished
    from plait.server.dashboard_probe import StepProbe

    reqs = [
        SimpleNamespace(
            rid=str(i),
            output_ids=[1] * 10,
            prompt_ids=[1] * 10,
            grammar=None,
            finished=False,
            first_token_time=0.0,
            arrival_time=0.0,
        )
        for i in range(batch_size)
    ]
    batch = SimpleNamespace(
        extends=[], verifies=[], decodes=reqs, decode_steps=1, requests=lambda: reqs
    )
    events = EngineEvents()

    def run() -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            if events.wants(StepFinished):  # as the engine emits it
                events.step_finished(batch, start)
            for r in reqs:
                r.output_ids.append(1)
        return time.perf_counter() - start

    plain = run()
    probe = StepProbe(SimpleNamespace(events=events))
    probe.install()
    watched = run()
    probe.uninstall()
    return (watched - plain) / repeats * 1e6


def run_dashboard_bench(args: argparse.Namespace) -> int:
    from plait.runtime.config_flags import engine_kwargs
    from plait.runtime.engine import Engine
    from plait.server import dashboard
    from plait.server.app import create_app
    from plait.server.launch import ServerThread

    engine = Engine(**engine_kwargs(args))
    config = dashboard.DashboardConfig(idle_after=1.0)
    rates = [float(r) for r in args.poll_hz.split(",") if r]
    prompt = engine.tokenizer.encode("Write a long story about a lighthouse keeper.")
    params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
    modes = dict(zip(["off", *[f"{r:g} Hz" for r in rates]], [0.0, *rates]))
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    latencies: dict[str, list[float]] = {m: [] for m in modes}
    builds: list[float] = []
    build = dashboard.build_snapshot

    def timed_build(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return build(*a, **kw)
        finally:
            builds.append(time.perf_counter() - start)

    dashboard.build_snapshot = timed_build  # the route looks it up by name at each request
    try:
        with ServerThread(create_app(engine, dashboard=config)) as server:
            view = dashboard.EngineView.of(engine, config)
            engine.generate(input_ids=[prompt] * args.concurrency, sampling_params=params)
            for i in range(args.rounds):
                order = list(modes) if i % 2 == 0 else list(modes)[::-1]
                for mode in order:
                    with (
                        watching(server.url, modes[mode], latencies[mode])
                        if modes[mode]
                        else nullcontext()
                    ):
                        served = len(builds)
                        while view.probe.installed != bool(modes[mode]) or (
                            modes[mode] and len(builds) == served
                        ):  # off: the probe came off; watched: this watcher was answered
                            time.sleep(0.05)
                        w, c = _round(engine, prompt, params, args.concurrency)
                    wall[mode].append(w)
                    cpu[mode].append(c)
    finally:
        dashboard.build_snapshot = build
        engine.shutdown()
    results = []
    for mode in modes:
        lat = latencies[mode]
        results.append(
            {
                "mode": mode,
                "step_ms": statistics.median(wall[mode]),
                "best_step_ms": min(wall[mode]),
                "cpu_ms_per_step": statistics.median(cpu[mode]),
                "rounds": wall[mode],
                "cpu_rounds": cpu[mode],
                "snapshot_ms_p50": statistics.median(lat) * 1000 if lat else None,
                "snapshots": len(lat),
            }
        )
    for r in results:
        r["overhead_pct"] = (r["step_ms"] / results[0]["step_ms"] - 1) * 100
        r["cpu_overhead_pct"] = (r["cpu_ms_per_step"] / results[0]["cpu_ms_per_step"] - 1) * 100
    probe_us = probe_cost_us(args.concurrency)
    build_ms = statistics.median(builds) * 1000 if builds else None
    print_table(
        [
            "watching",
            "wall ms/step (median)",
            "vs off %",
            "best",
            "CPU ms/step",
            "vs off %",
            "snapshot round trip ms",
        ],
        [
            [
                r["mode"],
                r["step_ms"],
                r["overhead_pct"],
                r["best_step_ms"],
                r["cpu_ms_per_step"],
                r["cpu_overhead_pct"],
                r["snapshot_ms_p50"],
            ]
            for r in results
        ],
    )
    print(
        f"\nthe probe alone: {probe_us:.1f} µs per step of {args.concurrency} decodes; "
        f"building a snapshot: {build_ms or 0:.2f} ms (median of {len(builds)})"
    )
    write_json(
        args.output,
        {
            "benchmark": "dashboard",
            "concurrency": args.concurrency,
            "output_len": args.output_len,
            "model": str(engine.model_path),
            "quantization": engine.config.model.quantization,
            "probe_us_per_step": probe_us,
            "snapshot_build_ms": build_ms,
            "results": results,
        },
    )
    return 0


def _round(engine: Any, prompt: list[int], params: dict, concurrency: int) -> tuple[float, float]:
    """Wall and process-CPU milliseconds per decode step for one batch of `concurrency`
    requests, after a short one (so each round starts from the same warm state)."""
    engine.generate(
        input_ids=[prompt] * concurrency, sampling_params={**params, "max_new_tokens": 8}
    )
    steps = engine.stats()["total_steps"]
    start, cpu = time.perf_counter(), time.process_time()
    engine.generate(input_ids=[prompt] * concurrency, sampling_params=params)
    elapsed, used = time.perf_counter() - start, time.process_time() - cpu
    n = max(engine.stats()["total_steps"] - steps, 1)
    return elapsed / n * 1000, used / n * 1000


if __name__ == "__main__":
    poll(sys.argv[1], float(sys.argv[2]))
