"""`plait bench dashboard`: what watching `/dashboard` costs a decode step.

The same batch of decode-only requests (`--concurrency` streams of `--output-len` tokens, one
shared prompt) runs in alternating rounds: nobody watching (the engine probe off), then a watcher
polling `/dashboard/snapshot` at each `--poll-hz` (1 Hz is what the page does; faster rates show
the trend). A round's figure is its wall time over the engine's decode steps. Also reported: how
long one snapshot takes to build on the server's event loop, and the probe's own cost per step
measured on a fake batch (no model), so the two parts of the cost are seen apart.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from plait.benchmarks.common import print_table, write_json


def add_dashboard_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", dest="output_len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per mode")
    parser.add_argument("--poll-hz", dest="poll_hz", default="1,10", help="comma-separated rates")
    parser.add_argument("--output", default="bench-results/dashboard.json")


@contextmanager
def watching(url: str, hz: float, latencies: list[float]) -> Iterator[None]:
    """A client polling the snapshot like the page does (incrementally, with `since`)."""
    import httpx

    stop = threading.Event()

    def poll() -> None:
        since = None
        with httpx.Client(base_url=url, timeout=30) as http:
            while not stop.is_set():
                start = time.perf_counter()
                params = {} if since is None else {"since": since}
                rows = http.get("/dashboard/snapshot", params=params).json()["history"]
                latencies.append(time.perf_counter() - start)
                since = rows[-1]["seq"] if rows else since
                stop.wait(max(1.0 / hz - (time.perf_counter() - start), 0.0))

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def probe_cost_us(batch_size: int, repeats: int = 20000) -> float:
    """Microseconds the installed probe adds to one `schedule` + `after_step` of a decode batch."""
    from plait.server.dashboard_probe import StepProbe

    class Scheduler:
        def schedule(self) -> Any:
            return batch

        def after_step(self, batch: Any) -> None:
            pass

    reqs = [SimpleNamespace(rid=str(i), output_ids=[1] * 10, prompt_ids=[1] * 10, grammar=None,
                            finished=False, first_token_time=0.0, arrival_time=0.0)
            for i in range(batch_size)]  # fmt: skip
    batch = SimpleNamespace(extends=[], decodes=reqs, decode_steps=1)
    sched = Scheduler()
    engine = SimpleNamespace(scheduler=sched, cache=SimpleNamespace(root=None))

    def run() -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            sched.after_step(sched.schedule())
            for r in reqs:
                r.output_ids.append(1)
        return time.perf_counter() - start

    plain = run()
    probe = StepProbe(engine)
    probe.install()
    watched = run()
    probe.uninstall()
    return (watched - plain) / repeats * 1e6


def run_dashboard_bench(args: argparse.Namespace) -> int:
    from plait.cli import engine_kwargs
    from plait.runtime.engine import Engine
    from plait.server.app import create_app
    from plait.server.dashboard import DashboardConfig, EngineView
    from plait.server.launch import ServerThread

    engine = Engine(**engine_kwargs(args))
    config = DashboardConfig(idle_after=1.0)
    rates = [float(r) for r in args.poll_hz.split(",") if r]
    prompt = engine.tokenizer.encode("Write a long story about a lighthouse keeper.")
    params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
    modes = ["off", *[f"{r:g} Hz" for r in rates]]
    step_ms: dict[str, list[float]] = {m: [] for m in modes}
    latencies: dict[str, list[float]] = {m: [] for m in modes[1:]}
    try:
        with ServerThread(create_app(engine, dashboard=config)) as server:
            view = EngineView.of(engine, config)
            engine.generate(
                input_ids=[prompt] * args.concurrency, sampling_params=params
            )  # warm up
            for _ in range(args.rounds):
                for mode, hz in zip(modes, [0.0, *rates]):
                    if hz == 0.0:
                        while view.probe.installed:  # the last watcher left; wait for the probe
                            time.sleep(0.1)
                        step_ms[mode].append(_round(engine, prompt, params, args.concurrency))
                        continue
                    with watching(server.url, hz, latencies[mode]):
                        while not view.probe.installed:
                            time.sleep(0.05)
                        step_ms[mode].append(_round(engine, prompt, params, args.concurrency))
    finally:
        engine.shutdown()
    base = statistics.median(step_ms["off"])  # medians: each round's order is the same
    results = []
    for mode in modes:
        ms = statistics.median(step_ms[mode])
        lat = latencies.get(mode) or []
        results.append({
            "mode": mode, "step_ms": ms, "overhead_pct": (ms / base - 1) * 100,
            "best_step_ms": min(step_ms[mode]), "rounds": step_ms[mode],
            "snapshot_ms_p50": statistics.median(lat) * 1000 if lat else None,
            "snapshot_ms_max": max(lat) * 1000 if lat else None, "snapshots": len(lat),
        })  # fmt: skip
    probe_us = probe_cost_us(args.concurrency)
    print_table(
        ["watching", "step ms (median)", "vs off %", "step ms (best)", "snapshot ms (P50)",
         "snapshot ms (max)"],
        [[r["mode"], r["step_ms"], r["overhead_pct"], r["best_step_ms"], r["snapshot_ms_p50"],
          r["snapshot_ms_max"]] for r in results],
    )  # fmt: skip
    print(f"\nthe probe alone: {probe_us:.1f} µs per step of {args.concurrency} decodes")
    write_json(args.output, {"benchmark": "dashboard", "concurrency": args.concurrency,
                             "output_len": args.output_len, "model": str(engine.model_path),
                             "quantization": engine.config.model.quantization,
                             "probe_us_per_step": probe_us, "results": results})  # fmt: skip
    return 0


def _round(engine: Any, prompt: list[int], params: dict, concurrency: int) -> float:
    """Milliseconds per decode step for one batch of `concurrency` requests, after a short one
    (so each round starts from the same warm state, however long the engine idled before)."""
    engine.generate(
        input_ids=[prompt] * concurrency, sampling_params={**params, "max_new_tokens": 8}
    )
    steps = engine.stats()["total_steps"]
    start = time.perf_counter()
    engine.generate(input_ids=[prompt] * concurrency, sampling_params=params)
    elapsed = time.perf_counter() - start
    return elapsed / max(engine.stats()["total_steps"] - steps, 1) * 1000
