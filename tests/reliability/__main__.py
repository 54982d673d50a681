"""`python -m tests.reliability`: soak, chaos and fuzz runs; prints the table, writes JSON and
exits non-zero if anything was lost, leaked or crashed. `--quick` is the CI-sized run."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from tests.reliability import chaos, fuzz, replicas, soak
from tests.reliability.report import Tally, table, write_json
from tests.reliability.serving import running_server, tiny_model_dir

PROGRAMS = "tests.reliability.programs"


@dataclass(frozen=True)
class Budget:
    soak_seconds: float = 150.0
    capacity_seconds: float = 15.0
    load: float = 4.0  # offered rate / measured capacity
    timeout: float = 20.0  # each soak request's deadline
    disconnects: int = 300
    aborts: int = 40
    fault_rounds: int = 10
    fuzz_examples: int = 25  # per operation and mode (valid / invalid bodies)
    body_examples: int = 400  # hostile body shapes per generation route
    constraint_examples: int = 150
    constraint_seconds: float = 90.0
    constraint_rss_mb: float = 256.0  # growth of the server process over the constraint fuzz
    exhaustion_requests: int = 12
    fuzz_timeout: float = 10.0  # the fuzzed server's default request deadline
    replica_requests: int = 24  # non-streamed requests when one of two replicas is killed


QUICK = Budget(
    soak_seconds=5,
    capacity_seconds=2,
    timeout=10,
    disconnects=40,
    aborts=8,
    fault_rounds=2,
    fuzz_examples=6,
    body_examples=150,
    constraint_examples=10,
    constraint_seconds=15,
    exhaustion_requests=6,
    fuzz_timeout=3,
    replica_requests=8,
)


def run(budget: Budget, model: Any, only: set[str], log: Any = print) -> list[Tally]:
    tallies: list[Tally] = []

    def done(t: Tally) -> None:
        tallies.append(t)
        log(f"  {t.name}: {'ok' if t.ok else 'FAILED'} in {t.seconds:.0f} s {t.extra or ''}")

    if only & {"chaos", "fuzz"}:
        engine_args = {
            "max_running_requests": 16,
            "context_length": 256,
            "grammar_compile_timeout": 10.0,
            "grammar_compile_memory_mb": 2048,
        }
        with running_server(
            model, engine_args, request_timeout=budget.fuzz_timeout, programs=(PROGRAMS,)
        ) as server:
            if "chaos" in only:
                done(chaos.disconnects(server, budget.disconnects))
                done(chaos.aborts(server, budget.aborts))
                done(chaos.faults(server, budget.fault_rounds))
            if "fuzz" in only:
                done(fuzz.fuzz_http(server, budget.fuzz_examples))
                done(fuzz.fuzz_bodies(server, budget.body_examples))
                done(
                    fuzz.fuzz_constraints(
                        server.engine,
                        budget.constraint_examples,
                        budget.constraint_seconds,
                        budget.constraint_rss_mb,
                    )
                )
        if "chaos" in only:
            done(chaos.pool_exhaustion(model, budget.exhaustion_requests))
    if only & {"chaos", "replicas"} and budget.replica_requests:
        done(replicas.replica_death(model, budget.replica_requests))
    if "soak" in only:
        with running_server(model, {"max_running_requests": 8}, max_queue=16) as server:
            capacity = soak.measure_capacity(server, budget.capacity_seconds, concurrency=8)
            log(f"  capacity: {capacity:.2f} requests/s; offering {budget.load:g}x")
            t = soak.soak(server, budget.soak_seconds, budget.load * capacity, budget.timeout)
            t.extra["capacity_rps"] = round(capacity, 2)
            done(t)
    return tallies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the CI-sized budget (~1 min)")
    parser.add_argument("--soak-seconds", type=float, default=None)
    parser.add_argument("--load", type=float, default=None, help="offered load / capacity (4)")
    parser.add_argument("--only", default="soak,chaos,fuzz", help="comma-separated runs")
    parser.add_argument("--model", default=None, help="default: a tiny random-weight model")
    parser.add_argument("--json", default="bench-results/reliability.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.CRITICAL)  # injected faults log tracebacks by design
    budget = QUICK if args.quick else Budget()
    if args.soak_seconds is not None:
        budget = Budget(**{**budget.__dict__, "soak_seconds": args.soak_seconds})
    if args.load is not None:
        budget = Budget(**{**budget.__dict__, "load": args.load})
    started = time.perf_counter()
    model = args.model or tiny_model_dir()
    tallies = run(budget, model, set(args.only.split(",")))
    print()
    print(table(tallies))
    for t in tallies:
        for note in t.notes:
            print(f"  {t.name}: {note}")
    write_json(
        args.json,
        tallies,
        {"budget": budget.__dict__, "model": str(model), "seconds": time.perf_counter() - started},
    )
    print(f"\nwrote {args.json} ({time.perf_counter() - started:.0f} s)")
    return 0 if all(t.ok for t in tallies) else 1


if __name__ == "__main__":
    sys.exit(main())
