"""`plait bench data-parallel`: a shared-prefix workload at a fixed concurrency through the
router, DP=2 with cache-aware routing vs DP=2 round-robin vs DP=1: throughput and cache hit rate.

Replicas are `plait serve` subprocesses splitting the machine's cores (DP=1 gets them all); the
router runs in this process. On a 2-core machine two replicas cannot be faster than one, so the
comparison there measures routing quality (cache hit rate) more than speed.

    plait bench data-parallel --num-prompts 64 --num-groups 8 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
from typing import Any

from plait.benchmarks.common import print_table, write_json


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data-parallel benchmark")
    g.add_argument("--model", dest="model_path", default=None, help="default: the embedded model")
    g.add_argument(
        "--num-prompts", dest="num_prompts", type=int, default=64, help="requests per setup"
    )
    g.add_argument("--num-groups", dest="num_groups", type=int, default=8, help="shared prefixes")
    g.add_argument("--prefix-len", dest="prefix_len", type=int, default=200, help="words")
    g.add_argument("--input-len", dest="input_len", type=int, default=16, help="words per request")
    g.add_argument("--output-len", dest="output_len", type=int, default=16, help="tokens")
    g.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    g.add_argument(
        "--max-total-tokens",
        dest="max_total_tokens",
        type=int,
        default=32768,
        help="KV pool tokens of each replica",
    )
    g.add_argument(
        "--setups",
        default="dp1,dp2-cache-aware,dp2-round-robin",
        help="comma-separated, of dp1, dp2-cache-aware, dp2-round-robin",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts and their order")
    g.add_argument(
        "--output", default="bench-results/data_parallel.json", help="JSON file of the results"
    )


def _replica_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--max-total-tokens", str(args.max_total_tokens), "--log-level", "warning"]
    return argv + (["--model", args.model_path] if args.model_path else [])


def _run(args: argparse.Namespace, urls: list[str], policy: str) -> dict[str, Any]:
    import httpx

    from plait.benchmarks.serving import make_dataset, run_load, summarize
    from plait.server.launch import ServerThread
    from plait.server.router_app import create_router_app
    from plait.server.routing import RouterConfig

    for url in urls:  # a first request pays one-time costs (kernel loading) outside the timing
        warm = {"text": "warm up", "sampling_params": {"max_new_tokens": 2}}
        httpx.post(url + "/generate", json=warm, timeout=300).raise_for_status()
        httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
    dataset = argparse.Namespace(
        seed=args.seed,
        num_groups=args.num_groups,
        num_prompts=args.num_prompts,
        dataset="shared-prefix",
        prefix_len=args.prefix_len,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=0.0,
    )
    prompts = make_dataset(dataset)
    random.Random(args.seed).shuffle(prompts)  # groups arrive in no pattern a policy could exploit
    app = create_router_app(urls, RouterConfig(policy=policy))
    try:
        with ServerThread(app) as router:
            results, duration = asyncio.run(
                run_load(
                    router.url,
                    "native",
                    prompts,
                    args.concurrency,
                    None,
                    600.0,
                )
            )
    finally:
        app.state.router.close()
    summary = summarize(results, duration)
    reasons: dict[str, int] = {}
    for sample in app.state.router.metrics.routed.collect()[0].samples:
        if sample.name.endswith("_total"):
            reason = sample.labels["reason"]
            reasons[reason] = reasons.get(reason, 0) + int(sample.value)
    served = [r.served for r in app.state.router.router.replicas]
    return {**summary, "policy": policy, "routing_reasons": reasons, "served_per_replica": served}


def run_data_parallel_bench(args: argparse.Namespace) -> int:
    from plait.server.data_parallel import start_replicas

    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    known = {"dp1", "dp2-cache-aware", "dp2-round-robin"}
    if not setups or set(setups) - known:
        raise SystemExit(f"bench data-parallel: --setups takes {', '.join(sorted(known))}")
    runs: dict[str, dict[str, Any]] = {}
    argv = _replica_argv(args)
    if "dp1" in setups:
        procs = start_replicas(argv, 1)
        try:
            runs["dp1"] = _run(args, [procs[0].url], "cache_aware")
        finally:
            procs[0].stop()
    if {"dp2-cache-aware", "dp2-round-robin"} & set(setups):
        procs = start_replicas(argv, 2)
        try:
            for name, policy in (
                ("dp2-cache-aware", "cache_aware"),
                ("dp2-round-robin", "round_robin"),
            ):
                if name in setups:
                    runs[name] = _run(args, [p.url for p in procs], policy)
        finally:
            for p in procs:
                p.stop()
    rows = []
    for name, r in runs.items():
        hit = r["cache_hit_rate"]
        rows.append(
            [
                name,
                r["completed"],
                r["failed"],
                r["request_throughput"],
                r["output_tok_s"],
                r["total_tok_s"],
                None if hit is None else 100 * hit,
                r["ttft_ms"]["median"],
                "/".join(map(str, r["served_per_replica"])),
            ]
        )
    print(
        f"\n{args.num_prompts} requests, {args.num_groups} shared prefixes of "
        f"{args.prefix_len} words, concurrency {args.concurrency}, {os.cpu_count()} CPUs"
    )
    print_table(
        [
            "setup",
            "ok",
            "fail",
            "req/s",
            "out tok/s",
            "tot tok/s",
            "cache hit %",
            "TTFT med ms",
            "served",
        ],
        rows,
    )
    write_json(
        args.output,
        {
            "config": {
                k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, type(None)))
            },
            "runs": runs,
        },
    )
    return 0
