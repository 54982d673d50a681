"""`plait bench throughput`: continuous batching and the radix cache under load.

1. Random prompts (64–512 tokens), fixed output length: plait at several client concurrencies
   beside transformers' `generate` on padded static batches, same model and dtype.
2. Shared prefix (a long few-shot prefix + different questions): plait with the radix cache on
   and off.

Beside each plait run: forward steps per second, and their share of the roofline (the steps/s of
a plain read of the weights one step reads, where they lie: `roofline.measure_weights_read`): a
step reads every weight once however many requests it serves, so at high concurrency the share
shows how close batching gets to the limit.

3. The decode step alone at each concurrency's batch (`decode_step_s`): the weight multiply-adds
   it does per second against the int8 dot products' peak measured in the same run
   (`kernels/roofs.py: int8_macs_per_second`): where a batch stops being bound by reading the
   weights and starts being bound by multiplying them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from plait.benchmarks.common import print_table, write_json


def random_prompts(n: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(low, high))] for _ in range(n)]


def shared_prefix_prompts(
    tokenizer: Any, n: int, prefix_len: int, seed: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    shots = []
    while sum(len(s) for s in shots) < prefix_len:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        shots.append(tokenizer.encode(f"Q: What is {a} plus {b}?\nA: {a + b}\n\n"))
    prefix = [t for s in shots for t in s][:prefix_len]
    return [
        prefix + tokenizer.encode(f"Q: What is {rng.randint(2, 99)} plus {i}?\nA:")
        for i in range(n)
    ]


def sampling(args: argparse.Namespace) -> dict:
    """The requests' sampling: greedy by default; `--temperature` / `--top-p` for sampled runs."""
    return {"temperature": getattr(args, "temperature", 0.0), "top_p": getattr(args, "top_p", 1.0)}


def run_plait(
    engine: Any,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    sample: dict | None = None,
) -> dict:
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True, **(sample or {})}
    ttfts: list[float] = []
    cached = 0

    def one(i: int) -> int:
        nonlocal cached
        ids = prompts[i]
        start = time.perf_counter()
        first = None
        last: dict = {}
        seeded = {**params, "seed": i} if params["temperature"] > 0 else params
        for chunk in engine.generate(input_ids=ids, sampling_params=seeded, stream=True):
            if first is None:
                first = time.perf_counter() - start
            last = chunk
        ttfts.append(first or 0.0)
        cached += last["meta_info"]["cached_tokens"]
        return last["meta_info"]["completion_tokens"]

    steps = engine.stats()["total_steps"]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        produced = sum(pool.map(one, range(len(prompts))))
    elapsed = time.perf_counter() - start
    steps = engine.stats()["total_steps"] - steps
    ttfts.sort()
    return {
        "steps_s": steps / elapsed,
        "concurrency": concurrency,
        "requests": len(prompts),
        "seconds": elapsed,
        "output_tok_s": produced / elapsed,
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "cache_hit_rate": cached / sum(len(p) for p in prompts),
    }


def decode_step_s(engine: Any, batch: int, steps: int = 32) -> float:
    """Seconds per decode step at `batch` rows: `batch` 16-token prompts decoded to 8 tokens and
    to 8 + `steps` (the prompts cached by a first run, so both runs prefill alike), the
    difference over `steps`; the best of two of each."""
    prompts = random_prompts(batch, 16, 16, seed=batch)
    params = {"temperature": 0, "ignore_eos": True}

    def run(tokens: int) -> float:
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": tokens})
        return time.perf_counter() - start

    run(8)
    short = min(run(8) for _ in range(2))
    return max(0.0, min(run(8 + steps) for _ in range(2)) - short) / steps


def run_transformers(
    model: Any,
    prompts: list[list[int]],
    output_len: int,
    batch_size: int,
    sample: dict | None = None,
) -> dict:
    sample = sample or {"temperature": 0.0}
    if sample["temperature"] > 0:
        how = {
            "do_sample": True,
            "temperature": sample["temperature"],
            "top_p": sample.get("top_p", 1.0),
        }
    else:
        how = {"do_sample": False}
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=0,
                eos_token_id=None,
                **how,
            )
            produced += (out.shape[1] - width) * len(chunk)
    elapsed = time.perf_counter() - start
    return {
        "batch_size": batch_size,
        "requests": len(prompts),
        "seconds": elapsed,
        "output_tok_s": produced / elapsed,
    }


def load_transformers(model_path: str | None, dtype: torch.dtype) -> Any:
    import os

    from plait.runtime.thirdparty import import_transformers

    transformers = import_transformers()

    from plait.runtime.model_loader.locate import locate_checkpoint

    loc = locate_checkpoint(model_path)
    if loc.kind == "gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(loc.path), gguf_file=os.path.basename(loc.path), dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(loc.path, dtype=torch.float32)
    return model.to(dtype).eval()


def _sampling_text(sample: dict) -> str:
    if sample["temperature"] <= 0:
        return "greedy"
    return f"temperature {sample['temperature']}, top-p {sample['top_p']}, seeded"


def run_throughput_bench(args: argparse.Namespace) -> int:
    from plait.runtime.config_flags import engine_kwargs
    from plait.runtime.engine import Engine

    kwargs = engine_kwargs(args)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.transformers else []
    prompts = random_prompts(args.num_requests, args.min_prompt_len, args.max_prompt_len)
    results: dict[str, Any] = {"random": [], "transformers": [], "shared_prefix": [], "decode": []}
    from plait.benchmarks.roofline import (
        measure_bandwidth,
        measure_weights_read,
        roofline_steps_s,
        weight_macs,
    )
    from plait.kernels.roofs import int8_macs_per_second
    from plait.runtime.engine import off_main_thread

    bandwidth = off_main_thread(measure_bandwidth)
    int8_peak = off_main_thread(int8_macs_per_second)
    engine = Engine(**kwargs)
    dtype = engine.dtype
    weight_bytes = engine.stats()["weight_bytes"]
    roofline = roofline_steps_s(
        measure_weights_read(engine), bandwidth, weight_bytes
    )  # steps/s reading only weights
    try:
        engine.generate(input_ids=prompts[0][:16], sampling_params={"max_new_tokens": 2})
        for c in concurrencies:
            engine.flush_cache()  # random prompts share nothing; keep runs independent
            results["random"].append(run_plait(engine, prompts, args.output_len, c, sampling(args)))
        macs = weight_macs(engine.core.model)
        for c in concurrencies:  # the decode step alone at each batch, against the int8 peak
            step = decode_step_s(engine, c)
            results["decode"].append(
                {"batch": c, "step_s": step, "weight_macs_s": macs * c / step if step else None}
            )
        shared = shared_prefix_prompts(engine.tokenizer, args.num_requests, args.prefix_len)
        engine.flush_cache()
        results["shared_prefix"].append(
            {
                "cache": "on",
                **run_plait(engine, shared, args.shared_output_len, args.shared_concurrency),
            }
        )
    finally:
        engine.shutdown()
    off = Engine(**{**kwargs, "disable_radix_cache": True})
    try:
        results["shared_prefix"].append(
            {
                "cache": "off",
                **run_plait(off, shared, args.shared_output_len, args.shared_concurrency),
            }
        )
    finally:
        off.shutdown()
    if batch_sizes:
        model = load_transformers(args.model_path, dtype)
        for b in batch_sizes:
            results["transformers"].append(
                run_transformers(model, prompts, args.output_len, b, sampling(args))
            )

    single = results["random"][0]["output_tok_s"]
    best_hf = max((r["output_tok_s"] for r in results["transformers"]), default=None)
    rows = []
    for r in results["random"]:
        rows.append(
            [
                f"plait c={r['concurrency']}",
                r["output_tok_s"],
                r["output_tok_s"] / single,
                r["output_tok_s"] / best_hf if best_hf else None,
                r["steps_s"],
                f"{r['steps_s'] / roofline:.0%}",
                r["ttft_mean_s"],
                r["ttft_p99_s"],
            ]
        )
    for r in results["transformers"]:
        rows.append(
            [
                f"transformers static b={r['batch_size']}",
                r["output_tok_s"],
                r["output_tok_s"] / single,
                r["output_tok_s"] / best_hf,
                None,
                None,
                None,
                None,
            ]
        )
    print(
        f"\n{args.num_requests} requests, prompts {args.min_prompt_len}-{args.max_prompt_len} "
        f"tokens, {args.output_len} output tokens ({_sampling_text(sampling(args))}), "
        f"dtype {str(dtype).removeprefix('torch.')}, "
        f"quantization {kwargs.get('quantization')}; roofline {roofline:.0f} steps/s "
        f"(weights read at {roofline * weight_bytes / 1e9:.1f} GB/s; "
        f"1 GiB probe {bandwidth / 1e9:.1f} GB/s)"
    )
    print_table(
        [
            "system",
            "output tok/s",
            "x plait c=1",
            "x best transformers",
            "steps/s",
            "of roofline",
            "TTFT mean s",
            "TTFT P99 s",
        ],
        rows,
    )
    print(
        "\ndecode step alone at each batch: weight multiply-adds per second against the int8 dot "
        "products' peak"
        + (
            f" ({int8_peak / 1e9:.0f} GMAC/s; two-level activations take two per weight)"
            if int8_peak
            else ""
        )
    )
    print_table(
        ["batch", "step ms", "decode tok/s", "weight GMAC/s", "of int8 peak"],
        [
            [
                d["batch"],
                d["step_s"] * 1e3,
                d["batch"] / d["step_s"] if d["step_s"] else None,
                d["weight_macs_s"] / 1e9 if d["weight_macs_s"] else None,
                f"{d['weight_macs_s'] / int8_peak:.0%}"
                if d["weight_macs_s"] and int8_peak
                else None,
            ]
            for d in results["decode"]
        ],
    )
    on, off_r = results["shared_prefix"]
    print(
        f"\nshared prefix: {args.prefix_len}-token prefix + {args.num_requests} questions, "
        f"{args.shared_output_len} output tokens, concurrency {args.shared_concurrency}"
    )
    print_table(
        ["radix cache", "seconds", "output tok/s", "hit rate", "speedup"],
        [
            [
                "on",
                on["seconds"],
                on["output_tok_s"],
                on["cache_hit_rate"],
                off_r["seconds"] / on["seconds"],
            ],
            ["off", off_r["seconds"], off_r["output_tok_s"], off_r["cache_hit_rate"], 1.0],
        ],
    )
    write_json(
        args.output,
        {
            "benchmark": "throughput",
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "bandwidth_bytes_s": bandwidth,
            "roofline_steps_s": roofline,
            "int8_macs_s": int8_peak,
            "results": results,
        },
    )
    return 0
