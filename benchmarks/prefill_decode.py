"""`plait bench pd`: prefill–decode disaggregation against colocated serving on the same cores.

Streams of short requests decode without pause while long prompts arrive every few seconds. Each
setup serves the same load through the router: `colocated` (one replica on every core),
`chunked` (the same with long prompts prefilled in small chunks between decode steps, the usual
remedy without a second replica), `pd` (a prefill replica and a decode replica, the cores split
between them) and `pd-long` (the same, but prompts under 1,000 characters are prefilled by the
decode replica: the short streams skip the round trip and the queue behind long prefills).
Reported: output tokens/s, TTFT and ITL (p50/p99) of the short streams, their ITL
p99 *while a long prompt is being prefilled* (the interference disaggregation removes), the long
prompts' TTFT, and for `pd` what moving the KV costs: bytes and milliseconds per long prompt,
measured on long prompts sent alone after the load.

    plait bench pd --long-len 1700 --num-long 4 --streams 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from plait.benchmarks.common import print_table, write_json

# replicas, of them prefill, replica flags, router settings
SETUPS: dict[str, tuple[int, int, list[str], dict[str, Any]]] = {
    "colocated": (1, 0, [], {}),
    "chunked": (1, 0, ["--chunked-prefill-size", "256"], {}),
    "pd": (2, 1, [], {}),
    "pd-long": (2, 1, [], {"prefill_min_chars": 1000}),  # short prompts prefill where they decode
}


def add_prefill_decode_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("prefill-decode benchmark")
    g.add_argument("--model", dest="model_path", default=None, help="default: the embedded model")
    g.add_argument("--quantization", default="int4", help="weight quantization of the replicas")
    g.add_argument("--page-size", dest="page_size", type=int, default=16, help="KV tokens per page")
    g.add_argument("--streams", type=int, default=4, help="short requests in flight at any time")
    g.add_argument(
        "--short-len", dest="short_len", type=int, default=48, help="words per short prompt"
    )
    g.add_argument(
        "--output-len", dest="output_len", type=int, default=64, help="tokens per short request"
    )
    g.add_argument(
        "--long-len", dest="long_len", type=int, default=1700, help="words per long prompt"
    )
    g.add_argument(
        "--long-output", dest="long_output", type=int, default=8, help="tokens per long request"
    )
    g.add_argument(
        "--num-long", dest="num_long", type=int, default=4, help="long prompts in the load"
    )
    g.add_argument(
        "--long-interval",
        dest="long_interval",
        type=float,
        default=8.0,
        help="seconds between long prompts (the first comes after as long)",
    )
    g.add_argument(
        "--max-total-tokens",
        dest="max_total_tokens",
        type=int,
        default=32768,
        help="KV pool tokens of each replica",
    )
    g.add_argument(
        "--setups",
        default="colocated,chunked,pd,pd-long",
        help="comma-separated, of " + ", ".join(SETUPS),
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    g.add_argument("--output", default="bench-results/pd.json", help="JSON file of the results")


@dataclass
class Stream:
    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per output token
    error: str = ""


async def _stream(client: Any, text: str, max_tokens: int) -> Stream:
    import json

    body = {
        "text": text,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    out = Stream(time.perf_counter())
    tokens = 0
    try:
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    return out
                now = time.perf_counter()
                new = chunk["meta_info"]["completion_tokens"] - tokens
                out.arrivals += [now] * max(new, 0)
                tokens += max(new, 0)
    except Exception as exc:  # a failed request is counted, not fatal
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def _words(rng: random.Random, n: int) -> str:
    from plait.benchmarks.serving import _WORDS

    return " ".join(rng.choice(_WORDS) for _ in range(n))


async def _load(url: str, args: argparse.Namespace) -> tuple[list[Stream], list[Stream], float]:
    import httpx

    rng = random.Random(args.seed)
    longs = [_words(rng, args.long_len) for _ in range(args.num_long)]
    shorts: list[Stream] = []
    done = asyncio.Event()
    timeout = httpx.Timeout(600, connect=10)
    limits = httpx.Limits(max_connections=args.streams + args.num_long + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def streamer(k: int) -> None:
            own = random.Random(args.seed * 1000 + k)
            while not done.is_set():
                shorts.append(await _stream(client, _words(own, args.short_len), args.output_len))

        async def long(j: int) -> Stream:
            await asyncio.sleep(args.long_interval * (j + 1))
            return await _stream(client, longs[j], args.long_output)

        start = time.perf_counter()
        streamers = [asyncio.ensure_future(streamer(k)) for k in range(args.streams)]
        long_results = await asyncio.gather(*(long(j) for j in range(args.num_long)))
        done.set()
        await asyncio.gather(*streamers)
        return shorts, list(long_results), time.perf_counter() - start


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _summary(shorts: list[Stream], longs: list[Stream], duration: float) -> dict[str, Any]:
    ok = [s for s in shorts if not s.error and s.arrivals]
    windows = [(s.sent, s.arrivals[0]) for s in longs if s.arrivals]
    itl: list[float] = []
    during: list[float] = []
    for s in ok:
        for a, b in zip(s.arrivals, s.arrivals[1:]):
            itl.append(b - a)
            if any(lo <= b and a <= hi for lo, hi in windows):  # overlaps a long prefill
                during.append(b - a)
    ttft = [s.arrivals[0] - s.sent for s in ok]
    long_ttft = [s.arrivals[0] - s.sent for s in longs if s.arrivals]
    output = sum(len(s.arrivals) for s in ok) + sum(len(s.arrivals) for s in longs)
    return {
        "duration_s": duration,
        "output_tok_s": output / duration,
        "short_requests": len(ok),
        "failed": [s.error for s in shorts + longs if s.error][:5],
        "short_ttft_ms": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)},
        "itl_ms": {"p50": _pct(itl, 0.5), "p99": _pct(itl, 0.99)},
        "itl_during_long_prefill_ms": {
            "p50": _pct(during, 0.5),
            "p99": _pct(during, 0.99),
            "samples": len(during),
        },
        "long_ttft_ms": {"p50": _pct(long_ttft, 0.5), "max": _pct(long_ttft, 1.0)},
    }


def _transfer(url: str, router: Any, args: argparse.Namespace) -> dict[str, Any]:
    """KV moved per long prompt, each sent alone: bytes, push and prefill milliseconds."""
    import httpx

    names = [
        f"plait_router_kv_handoff_{n}_total"
        for n in ("bytes", "push_seconds", "prefill_seconds", "tokens")
    ]

    def read() -> list[float]:
        return [router.metrics.registry.get_sample_value(n) or 0.0 for n in names]

    rng = random.Random(args.seed + 1)
    per: list[dict[str, float]] = []
    for _ in range(2):
        before = read()
        body = {"text": _words(rng, args.long_len), "sampling_params": {"max_new_tokens": 1}}
        httpx.post(url + "/generate", json=body, timeout=600).raise_for_status()
        after = read()
        moved, push, prefill, tokens = (b - a for a, b in zip(before, after))
        per.append(
            {"tokens": tokens, "bytes": moved, "push_ms": 1000 * push, "prefill_ms": 1000 * prefill}
        )
    return {k: sum(p[k] for p in per) / len(per) for k in per[0]}


def _run(args: argparse.Namespace, setup: str) -> dict[str, Any]:
    import httpx

    from plait.server.data_parallel import start_replicas
    from plait.server.launch import ServerThread
    from plait.server.router_app import create_router_app
    from plait.server.routing import Router, RouterConfig

    count, prefill, extra, routing = SETUPS[setup]
    argv = [
        "--max-total-tokens",
        str(args.max_total_tokens),
        "--page-size",
        str(args.page_size),
        "--log-level",
        "warning",
        *extra,
    ]
    if args.quantization:
        argv += ["--quantization", args.quantization]
    if args.model_path:
        argv += ["--model", args.model_path]
    roles = ["decode", "prefill"] if prefill else None
    procs = start_replicas(argv, count, roles=roles)
    try:
        urls = [p.url for p in procs]
        config = RouterConfig(**routing)
        router = Router.for_urls(urls[: count - prefill], config, urls[count - prefill :])
        app = create_router_app(router)
        try:
            with ServerThread(app) as server:
                warm = {
                    "text": _words(random.Random(7), 300),
                    "sampling_params": {"max_new_tokens": 4},
                }
                httpx.post(server.url + "/generate", json=warm, timeout=600).raise_for_status()
                for url in urls:
                    httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
                shorts, longs, duration = asyncio.run(_load(server.url, args))
                result = _summary(shorts, longs, duration)
                if prefill:
                    result["transfer"] = _transfer(server.url, app.state.router, args)
        finally:
            app.state.router.close()
    finally:
        for p in procs:
            p.stop()
    return {
        "setup": setup,
        "replicas": count,
        "prefill_replicas": prefill,
        "flags": extra,
        "router": routing,
        **result,
    }


def run_prefill_decode_bench(args: argparse.Namespace) -> int:
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not setups or set(setups) - set(SETUPS):
        raise SystemExit(f"bench pd: --setups takes {', '.join(SETUPS)}")
    runs = {name: _run(args, name) for name in setups}
    rows = []
    for name, r in runs.items():
        t = r.get("transfer")
        rows.append(
            [
                name,
                r["output_tok_s"],
                r["short_ttft_ms"]["p50"],
                r["itl_ms"]["p50"],
                r["itl_ms"]["p99"],
                r["itl_during_long_prefill_ms"]["p99"],
                r["long_ttft_ms"]["p50"],
                t and t["bytes"] / 1e6,
                t and t["push_ms"],
                len(r["failed"]),
            ]
        )
    print(
        f"\n{args.streams} short streams ({args.short_len} words in, {args.output_len} out), "
        f"{args.num_long} long prompts of {args.long_len} words every {args.long_interval:g} s, "
        f"{os.cpu_count()} CPUs split between the replicas"
    )
    print_table(
        [
            "setup",
            "out tok/s",
            "TTFT p50 ms",
            "ITL p50",
            "ITL p99",
            "ITL p99 in prefill",
            "long TTFT p50",
            "KV MB/long",
            "push ms/long",
            "failed",
        ],
        rows,
    )
    config = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, type(None)))}
    write_json(args.output, {"benchmark": "pd", "config": config, "runs": runs})
    return 0
