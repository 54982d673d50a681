"""`plait bench kv-tiers`: what the local disk tier buys.

- **restart**: the time to first token of a request whose long prefix an earlier engine served,
  on a fresh engine: warm from the disk tier vs cold (no tier). Each engine serves a short
  unrelated request first, so one-time costs stay out of the timing.
- **working set**: more distinct prefixes than the pool holds, cycled: after one pass over all of
  them (which fills the tiers), `--requests` requests cycle through them again, at a fixed
  concurrency: the prompt tokens served from cache, and output tokens per second, with and
  without the disk tier. Cycling in order is the pool's worst case: each prefix was evicted by
  the time it comes back.
- **shared**: two replicas on one Redis tier: the second replica's time to first token on a
  `--prefix-len` prefix the first one computed, against a cold engine's. The Redis server is
  `--kv-redis`, or a `redis-server` the benchmark starts on a free loopback port (the part is
  skipped, saying so, where there is neither).

    plait bench kv-tiers --prefix-len 4000 --num-prefixes 64 --shared-len 2000 --requests 256
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from plait.benchmarks.common import print_table, write_json


def add_kv_tiers_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("kv-tiers benchmark")
    g.add_argument("--model", dest="model_path", default=None, help="default: the embedded model")
    g.add_argument("--quantization", default="int4", help="weight quantization of the engines")
    g.add_argument("--page-size", dest="page_size", type=int, default=16, help="KV tokens per page")
    g.add_argument(
        "--prefix-len",
        dest="prefix_len",
        type=int,
        default=4000,
        help="restart: tokens of the prefix served before the restart",
    )
    g.add_argument(
        "--num-prefixes",
        dest="num_prefixes",
        type=int,
        default=64,
        help="working set: distinct prefixes",
    )
    g.add_argument(
        "--shared-len",
        dest="shared_len",
        type=int,
        default=2000,
        help="working set: tokens of each prefix",
    )
    g.add_argument("--requests", type=int, default=256, help="working set: requests cycling them")
    g.add_argument(
        "--pool-prefixes",
        dest="pool_prefixes",
        type=float,
        default=10,
        help="working set: prefixes the KV pool holds",
    )
    g.add_argument(
        "--output-len", dest="output_len", type=int, default=8, help="tokens per request"
    )
    g.add_argument("--concurrency", type=int, default=4, help="working set: requests in flight")
    g.add_argument(
        "--parts",
        default="restart,working-set,shared",
        help="comma-separated: restart, working-set, shared",
    )
    g.add_argument(
        "--kv-redis",
        dest="kv_redis",
        default=None,
        help="shared: the Redis both replicas use (default: a redis-server started for the run)",
    )
    g.add_argument(
        "--kv-disk-dir",
        dest="kv_disk_dir",
        default=None,
        help="where the disk tier's blocks go (default: a temporary directory)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    g.add_argument(
        "--output", default="bench-results/kv_tiers.json", help="JSON file of the results"
    )


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _engine(args: argparse.Namespace, **extra: Any) -> Any:
    from plait import Engine

    return Engine(
        model_path=args.model_path,
        quantization=args.quantization,
        page_size=args.page_size,
        **extra,
    )


def _warm(engine: Any, rng: random.Random) -> None:
    engine.generate(input_ids=_ids(rng, 64), sampling_params={"max_new_tokens": 2})


def _drop_page_cache() -> bool:
    """Asks the OS to forget cached file pages (root on Linux), so reads come from the disk."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _ttft(engine: Any, ids: list[int]) -> tuple[float, int]:
    started = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    return time.perf_counter() - started, out["meta_info"]["cached_tokens"]


def _written(engine: Any, timeout: float = 120.0) -> dict[str, Any]:
    """The engine's stats once its tier writes have all landed."""
    deadline = time.monotonic() + timeout
    while (stats := engine.stats())["kv_tiers_pending_write_bytes"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return stats


def _tier_against_cold(
    args: argparse.Namespace, seed: int, tier: dict[str, str], drop_page_cache: bool = False
) -> dict[str, Any]:
    """One engine on `tier` serves a `--prefix-len` prefix; a second, fresh engine on the same
    tier and a cold one without it are timed to the first token of the same prompt."""
    rng = random.Random(seed)
    prefix = _ids(rng, args.prefix_len)
    with _engine(args, **tier) as first:
        _warm(first, rng)
        first.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1})
        written = _written(first)
    dropped = _drop_page_cache() if drop_page_cache else False
    with _engine(args, **tier) as second:
        _warm(second, rng)
        warm_s, warm_cached = _ttft(second, prefix)
        stats = second.stats()
    with _engine(args) as cold:
        _warm(cold, rng)
        cold_s, _ = _ttft(cold, prefix)
    return {
        "cold_s": cold_s,
        "warm_s": warm_s,
        "warm_cached": warm_cached,
        "written": written,
        "stats": stats,
        "page_cache_dropped": dropped,
    }


def run_restart(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    t = _tier_against_cold(args, args.seed, {"kv_disk": directory}, drop_page_cache=True)
    stats = t["stats"]
    return {
        "prefix_tokens": args.prefix_len,
        "cold_ttft_s": t["cold_s"],
        "warm_ttft_s": t["warm_s"],
        "warm_over_cold": t["warm_s"] / t["cold_s"],
        "warm_cached_tokens": t["warm_cached"],
        "page_cache_dropped": t["page_cache_dropped"],
        "disk_load_seconds_mean": stats["kv_disk_load_seconds_mean"],
        "disk_bytes_read": stats["kv_disk_promotions"]
        * stats["kv_disk_bytes"]
        / max(stats["kv_disk_blocks"], 1),
    }


@contextlib.contextmanager
def _redis_url(url: str | None, directory: str) -> Iterator[str | None]:
    """`url`, or a redis-server started on a free loopback port for the run (None: not
    installed)."""
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.makedirs(directory, exist_ok=True)
    command = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        directory,
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:  # until it accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


def run_shared(args: argparse.Namespace, url: str) -> dict[str, Any]:
    t = _tier_against_cold(args, args.seed + 1, {"kv_redis": url})
    return {
        "prefix_tokens": args.prefix_len,
        "cold_ttft_s": t["cold_s"],
        "second_replica_ttft_s": t["warm_s"],
        "second_over_cold": t["warm_s"] / t["cold_s"],
        "second_replica_cached_tokens": t["warm_cached"],
        "redis_blocks_written": t["written"]["kv_redis_demotions"],
        "redis_load_seconds_mean": t["stats"]["kv_redis_load_seconds_mean"],
    }


def run_working_set(args: argparse.Namespace, directory: str | None) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    prefixes = [_ids(rng, args.shared_len) for _ in range(args.num_prefixes)]
    suffix = 16
    per_request = args.shared_len + suffix + args.output_len
    pool = int(args.pool_prefixes * per_request)
    pool += -pool % args.page_size
    extra: dict[str, Any] = {"max_total_tokens": pool}
    if directory is not None:
        extra["kv_disk"] = directory
    prompts = [prefixes[i % args.num_prefixes] + _ids(rng, suffix) for i in range(args.requests)]
    first_pass = [p + _ids(rng, suffix) for p in prefixes]
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    with _engine(args, **extra) as engine:
        _warm(engine, rng)
        with ThreadPoolExecutor(args.concurrency) as pool_:
            list(
                pool_.map(
                    lambda ids: engine.generate(input_ids=ids, sampling_params=params), first_pass
                )
            )
            if directory is not None:
                deadline = time.monotonic() + 600
                while (
                    engine.stats()["kv_tiers_pending_write_bytes"] and time.monotonic() < deadline
                ):
                    time.sleep(0.05)
            before = engine.stats()
            started = time.perf_counter()
            outs = list(
                pool_.map(
                    lambda ids: engine.generate(input_ids=ids, sampling_params=params), prompts
                )
            )
            duration = time.perf_counter() - started
        stats = engine.stats()
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    output = sum(o["meta_info"]["completion_tokens"] for o in outs)
    row = {
        "setup": "disk tier" if directory is not None else "pool only",
        "pool_tokens": pool,
        "requests": len(outs),
        "hit_rate": cached / prompt_tokens,
        "output_tok_s": output / duration,
        "duration_s": duration,
    }
    if directory is not None:
        row["disk_promotions"] = stats["kv_disk_promotions"] - before["kv_disk_promotions"]
        row["disk_load_seconds_mean"] = stats["kv_disk_load_seconds_mean"]
        row["disk_bytes"] = stats["kv_disk_bytes"]
        row["late_loads"] = stats["kv_tiers_late_loads"] - before["kv_tiers_late_loads"]
    return row


def run_kv_tiers_bench(args: argparse.Namespace) -> int:
    parts = set(args.parts.split(","))
    own = args.kv_disk_dir is None
    base = args.kv_disk_dir or tempfile.mkdtemp(prefix="plait-kv-bench-")
    results: dict[str, Any] = {"benchmark": "kv_tiers", "config": vars(args).copy()}
    results["config"].pop("func", None)
    try:
        if "restart" in parts:
            r = run_restart(args, f"{base}/restart")
            results["restart"] = r
            print(f"\nrestart: TTFT of a {r['prefix_tokens']}-token prefix served before it")
            print_table(
                [
                    "cold TTFT s",
                    "warm TTFT s",
                    "warm / cold",
                    "cached tokens",
                    "page cache dropped",
                ],
                [
                    [
                        r["cold_ttft_s"],
                        r["warm_ttft_s"],
                        f"{r['warm_over_cold']:.1%}",
                        r["warm_cached_tokens"],
                        r["page_cache_dropped"],
                    ]
                ],
            )
        if "working-set" in parts:
            rows = [run_working_set(args, None), run_working_set(args, f"{base}/working-set")]
            results["working_set"] = rows
            speedup = rows[1]["output_tok_s"] / rows[0]["output_tok_s"]
            results["working_set_speedup"] = speedup
            print(
                f"\nworking set: {args.num_prefixes} prefixes of {args.shared_len} tokens, "
                f"{args.requests} requests cycling them, pool of ~{args.pool_prefixes:g}"
            )
            print_table(
                ["setup", "hit rate", "output tok/s", "seconds"],
                [
                    [r["setup"], f"{r['hit_rate']:.1%}", r["output_tok_s"], r["duration_s"]]
                    for r in rows
                ],
            )
            print(f"disk tier / pool only: {speedup:.2f}x output tok/s")
        if "shared" in parts:
            with _redis_url(args.kv_redis, f"{base}/redis") as url:
                if url is None:
                    print("\nshared: skipped (no --kv-redis, and redis-server is not installed)")
                else:
                    r = run_shared(args, url)
                    results["shared"] = r
                    print(
                        f"\nshared: TTFT of a {r['prefix_tokens']}-token prefix a replica computed"
                    )
                    print_table(
                        ["cold TTFT s", "second replica TTFT s", "second / cold", "cached tokens"],
                        [
                            [
                                r["cold_ttft_s"],
                                r["second_replica_ttft_s"],
                                f"{r['second_over_cold']:.1%}",
                                r["second_replica_cached_tokens"],
                            ]
                        ],
                    )
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)
    write_json(args.output, results)
    return 0
