"""`plait bench serving`: a load generator for a running server (plait, SGLang, llama.cpp, vLLM…).

Sends streamed requests from a synthetic dataset (random lengths, or groups sharing a long
prefix) at a fixed concurrency or a Poisson request rate, bounded in count and in time, and
prints request / token throughput, TTFT, ITL, TPOT and end-to-end latency (mean, median, P99)
and the prefix-cache hit rate (from `meta_info.cached_tokens` or
`usage.prompt_tokens_details.cached_tokens`, where the server reports them).

    plait bench serving --url http://127.0.0.1:30000 --backend native --concurrency 1,4,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

# Stream events closer together than this count as one arrival in `spaced_events_per_token`: a
# client reading them sees them at once (a token streamed on its own arrives a decode step later).
SPACED_EVENT_S = 0.001
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()


@dataclass
class Prompt:
    text: str
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    events: int = 0  # stream events that brought new tokens
    spaced_events: int = 0  # of those, events that came at least SPACED_EVENT_S after the last
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None


def make_dataset(args: argparse.Namespace, seed: int | None = None) -> list[Prompt]:
    """`random`: input/output lengths uniform in [len * (1 - range_ratio), len]; `shared-prefix`:
    `num_groups` prefixes of `prefix_len` words, each request adds `input_len` words of its own."""
    rng = random.Random(args.seed if seed is None else seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * (1 - args.range_ratio))), n)

    prompts = []
    prefixes = [words(args.prefix_len) for _ in range(args.num_groups)]
    for i in range(args.num_prompts):
        if args.dataset == "shared-prefix":
            text = prefixes[i % args.num_groups] + "\nQuestion: " + words(args.input_len)
            prompts.append(Prompt(text, args.output_len))
        else:
            prompts.append(Prompt(words(length(args.input_len)), length(args.output_len)))
    return prompts


def _payload(
    backend: str, prompt: Prompt, model: str, sampling: dict[str, float] | None = None
) -> tuple[str, dict[str, Any]]:
    """The request for one prompt: greedy unless `sampling` ({"temperature", "top_p"}) says
    otherwise."""
    sampling = {"temperature": 0, **(sampling or {})}
    if backend == "native":
        params = {"max_new_tokens": prompt.output_len, "ignore_eos": True, **sampling}
        return "/generate", {"text": prompt.text, "sampling_params": params, "stream": True}
    body = {
        "model": model,
        "prompt": prompt.text,
        "max_tokens": prompt.output_len,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }
    return "/v1/completions", body


async def _send(
    client: Any, backend: str, prompt: Prompt, model: str, sampling: dict[str, float] | None = None
) -> Result:
    path, body = _payload(backend, prompt, model, sampling)
    result = Result()
    start = last = time.perf_counter()
    tokens = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if backend == "native":
                    meta = chunk["meta_info"]
                    new = meta["completion_tokens"] - tokens
                    result.prompt_tokens = meta["prompt_tokens"]
                    result.cached_tokens = meta.get("cached_tokens")
                else:
                    usage = chunk.get("usage") or {}
                    if usage:
                        result.prompt_tokens = usage.get("prompt_tokens", 0)
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached_tokens = details.get("cached_tokens")
                        new = usage.get("completion_tokens", tokens) - tokens
                    else:
                        new = sum(1 for c in chunk.get("choices", []) if c.get("text"))
                if new <= 0:
                    continue
                if tokens == 0:
                    result.ttft = now - start
                else:
                    result.itls.extend([(now - last) / new] * new)
                result.events += 1
                result.spaced_events += tokens == 0 or now - last >= SPACED_EVENT_S
                tokens += new
                last = now
        result.latency = time.perf_counter() - start
        result.output_tokens = tokens
        result.ok = tokens > 0
        if not result.ok:
            result.error = "no tokens"
    except Exception as e:  # a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_load(
    url: str,
    backend: str,
    prompts: list[Prompt],
    concurrency: int | None,
    request_rate: float | None,
    max_duration: float,
    model: str = "default",
    seed: int = 0,
    sampling: dict[str, float] | None = None,
) -> tuple[list[Result], float]:
    """Sends `prompts` (at most `concurrency` in flight; Poisson arrivals at `request_rate`/s),
    launching none after `max_duration` s; returns the results and the wall time."""
    import httpx

    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency or len(prompts) or 1)
    timeout = httpx.Timeout(max_duration + 60, connect=10)
    limits = httpx.Limits(max_connections=(concurrency or len(prompts)) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        tasks = []

        async def one(p: Prompt) -> Result:
            async with limit:
                return await _send(client, backend, p, model, sampling)

        for p in prompts:
            if time.perf_counter() - start > max_duration:
                break
            if concurrency is not None:
                await limit.acquire()  # launch only when a slot is free (keeps timing honest)
                limit.release()
            tasks.append(asyncio.ensure_future(one(p)))
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
            else:
                await asyncio.sleep(0)
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        "mean": statistics.fmean(values) * scale,
        "median": statistics.median(values) * scale,
        "p99": p99 * scale,
    }


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_tok_s": prompt / duration,
        "output_tok_s": output / duration,
        "total_tok_s": (prompt + output) / duration,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cache_hit_rate": sum(cached) / prompt if cached and prompt else None,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "itl_ms": _stats([x for r in ok for x in r.itls]),
        "tpot_ms": _stats(tpots),
        "e2e_ms": _stats([r.latency for r in ok]),
        # how tokens arrived: 1.0 is one event per token, each on its own
        "events_per_token": sum(r.events for r in ok) / output if output else None,
        "spaced_events_per_token": sum(r.spaced_events for r in ok) / output if output else None,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "samples": {
            "ttft_ms": _sample([r.ttft for r in ok]),
            "itl_ms": _sample([x for r in ok for x in r.itls]),
        },  # for --plot's distributions
    }


def _sample(values: list[float], limit: int = 2000, scale: float = 1000.0) -> list[float]:
    """At most `limit` of the values (every k-th), in ms: enough to draw their distribution."""
    step = max(1, -(-len(values) // limit))
    return [round(v * scale, 3) for v in values[::step]]


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serving benchmark")
    g.add_argument("--url", default="http://127.0.0.1:30000", help="the server")
    g.add_argument(
        "--backend",
        choices=["native", "openai"],
        default="native",
        help="native: POST /generate (plait, SGLang); openai: POST /v1/completions",
    )
    g.add_argument(
        "--model-name",
        dest="model_name",
        default=None,
        help="the model field (openai; default: the first id the server's /v1/models lists)",
    )
    g.add_argument(
        "--dataset",
        choices=["random", "shared-prefix"],
        default="random",
        help="random words, or questions after one of --num-groups shared prefixes",
    )
    g.add_argument(
        "--num-prompts", dest="num_prompts", type=int, default=64, help="requests per run"
    )
    g.add_argument("--input-len", dest="input_len", type=int, default=128, help="words")
    g.add_argument("--output-len", dest="output_len", type=int, default=64, help="tokens")
    g.add_argument(
        "--range-ratio",
        dest="range_ratio",
        type=float,
        default=0.5,
        help="lengths are drawn from [len * (1 - ratio), len]",
    )
    g.add_argument(
        "--prefix-len", dest="prefix_len", type=int, default=512, help="shared-prefix words"
    )
    g.add_argument("--num-groups", dest="num_groups", type=int, default=4, help="shared prefixes")
    g.add_argument("--concurrency", default="1,4,16", help="comma-separated; one run each")
    g.add_argument(
        "--request-rate",
        dest="request_rate",
        type=float,
        default=None,
        help="requests/s (Poisson); default: as fast as concurrency allows",
    )
    g.add_argument(
        "--max-duration",
        dest="max_duration",
        type=float,
        default=120.0,
        help="seconds per run after which no request is launched",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths")
    g.add_argument(
        "--label", default=None, help="name of the server in the table and JSON (default: its URL)"
    )
    g.add_argument(
        "--output",
        "--serving-output",
        dest="output",
        default="bench-results/serving.json",
        help="JSON file the runs are added to (replacing earlier runs of the same label)",
    )


def run_serving_bench(args: argparse.Namespace) -> int:
    from plait.benchmarks.common import print_table

    if args.num_prompts < 1 or args.max_duration <= 0:
        raise SystemExit("bench serving: --num-prompts and --max-duration must be positive")
    label = args.label or args.url
    model = args.model_name or (listed_model(args.url) if args.backend == "openai" else "default")
    rows, runs = [], []
    for level in [int(c) for c in str(args.concurrency).split(",") if c.strip()]:
        # NOTE: new prompts per run, so a run never hits the cache the previous one left
        prompts = make_dataset(args, seed=args.seed * 1000 + level)
        results, duration = asyncio.run(
            run_load(
                args.url,
                args.backend,
                prompts,
                level,
                args.request_rate,
                args.max_duration,
                model,
                args.seed,
            )
        )
        summary = summarize(results, duration)
        runs.append({"concurrency": level, **summary})
        rows.append(
            [
                label,
                level,
                summary["completed"],
                summary["failed"],
                summary["request_throughput"],
                summary["output_tok_s"],
                summary["total_tok_s"],
                summary["ttft_ms"]["mean"],
                summary["ttft_ms"]["median"],
                summary["ttft_ms"]["p99"],
                summary["itl_ms"]["mean"],
                summary["itl_ms"]["median"],
                summary["itl_ms"]["p99"],
                summary["tpot_ms"]["mean"],
                summary["e2e_ms"]["median"],
                summary["cache_hit_rate"],
                summary["spaced_events_per_token"],
            ]
        )
        if summary["errors"]:
            print(f"errors at concurrency {level}: {summary['errors']}")
    print_table(
        [
            "server",
            "conc",
            "ok",
            "fail",
            "req/s",
            "out tok/s",
            "tot tok/s",
            "TTFT mean",
            "TTFT med",
            "TTFT p99",
            "ITL mean",
            "ITL med",
            "ITL p99",
            "TPOT mean",
            "E2E med",
            "cache hit",
            "events/tok",
        ],
        rows,
    )
    print(
        f"(latencies in ms; events/tok: stream events at least {SPACED_EVENT_S * 1000:g} ms apart "
        "per token)"
    )
    _write(
        args.output,
        {
            "label": label,
            "config": {
                k: v
                for k, v in vars(args).items()
                if isinstance(v, (str, int, float, bool, type(None)))
            },
            "runs": runs,
        },
    )
    return 0


def listed_model(url: str) -> str:
    """The first model id the server lists (`GET /v1/models`), else "default"."""
    import httpx

    try:
        return httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def _write(path: str, payload: dict[str, Any]) -> None:
    import os

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    existing: list[Any] = []
    if os.path.exists(path):
        try:
            with open(path) as f:
                loaded = json.load(f)
            existing = loaded if isinstance(loaded, list) else [loaded]
        except (OSError, json.JSONDecodeError):
            existing = []
    existing = [e for e in existing if e.get("label") != payload["label"]] + [payload]
    with open(path, "w") as f:
        json.dump(existing, f, indent=2)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plait bench serving", description=__doc__.split("\n")[0])
    add_serving_args(parser)
    return run_serving_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
