"""`plait bench latency`: prefill and single-stream decode speed against the machine's limits,
plait beside transformers and llama.cpp.

Formats are float32 / bfloat16 (dtypes: a GGUF's blocks dequantized), native (the default: a
GGUF's blocks as stored where the quantized kernels read them, float32 compute), int8 / int4
(weight-only quantization, float32 compute) or deterministic (native, with every step
batch-invariant: what `deterministic=True` costs). For each, plait's prefill (512-token prompt) and
decode (128 tokens, one stream; greedy, and sampled at temperature 0.7 and top-p 0.9 beside it), the
weights one decode step reads (`weight_bytes`), the roofline (the steps/s of a plain read of
those very weights where they lie, `measure_weights_read`) and the share of it reached (the
median over the decode runs, each against the faster of the reads just before and after it: the
VM's memory bandwidth drifts within seconds), in parentheses the share of the roofline by a fixed
1 GiB probe (whose rate on a VM depends on the allocation it is given, and is often below that of
the weights themselves), the
prefill's share of the measured float32 matmul rate (its FLOPs: the projections' 2 per weight
per token, plus causal attention's 2 * layers * heads * head_dim * T^2), and the perplexity of the
second half of a fixed text, computed over its first half read back from the KV cache (so that the
cache's storage format counts). transformers runs the float dtypes on the same weights;
llama-cpp-python (if installed: `make bench-deps`) runs the GGUF file itself once, with the same
thread count. `--kv-cache-dtype` stores plait's KV cache as bfloat16 or int8 (the perplexity
column shows what that costs). Everything runs in one process, one after the other.

Each system's runs are in `latency_runs.py`, the machine's limits in `roofline.py`.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from plait.benchmarks.common import cpu_model, print_table, write_json
from plait.benchmarks.latency_runs import (
    _DTYPES,
    FORMATS,
    _format_kwargs,
    measure_llama_cpp,
    measure_plait,
    measure_transformers,
)
from plait.benchmarks.roofline import measure_bandwidth, measure_matmul_flops, roofline_steps_s
from plait.kernels.quant_matmul import bf16_gemm_enabled, cpu_kind, native_isa
from plait.runtime.config_flags import engine_kwargs


def bench_model(
    args: argparse.Namespace,
    model_path: str | None,
    formats: list[str],
    repeats: int,
    bandwidth: float,
    matmul_flops: float,
) -> tuple[dict[str, Any], list[list[Any]]]:
    """One model's figures in every format (and llama.cpp's on its GGUF): (results, table rows)."""
    from plait.benchmarks.model_reference import llama_cpp_agreement, measure_kv
    from plait.runtime.engine import off_main_thread

    kv_dtype = getattr(args, "kv_cache_dtype", "auto")
    results: dict[str, dict[str, Any]] = {}
    rows: list[list[Any]] = []
    for fmt in formats:
        ours = measure_plait(
            model_path,
            fmt,
            args.prompt_len,
            args.decode_len,
            repeats,
            kv_dtype,
            engine_kwargs(args),
        )
        ref = (
            off_main_thread(
                measure_transformers, model_path, fmt, args.prompt_len, args.decode_len, repeats
            )
            if args.transformers and fmt in _DTYPES
            else None
        )
        roofline = roofline_steps_s(ours["weights_read_s"], bandwidth, ours["weight_bytes"])
        probe_roofline = bandwidth / ours["weight_bytes"]  # by the 1 GiB probe, in parentheses
        prefill_share = ours["prefill_tok_s"] * ours["prefill_flops_per_token"] / matmul_flops
        results[fmt] = {
            "plait": ours,
            "transformers": ref,
            "roofline_steps_s": roofline,
            "probe_roofline_steps_s": probe_roofline,
            "prefill_share_of_matmul": prefill_share,
        }
        share = ours["decode_share_of_roofline"] or ours["decode_tok_s"] / roofline
        rows += [
            [
                fmt,
                f"prefill tok/s ({args.prompt_len})",
                ours["prefill_tok_s"],
                f"{prefill_share:.0%} of matmul",
                ref and ref["prefill_tok_s"],
                ours["perplexity"],
            ],
            [
                fmt,
                f"decode tok/s ({args.decode_len})",
                ours["decode_tok_s"],
                f"{share:.0%} of {roofline:.0f} "
                f"({ours['decode_tok_s'] / probe_roofline:.0%} of {probe_roofline:.0f})",
                ref and ref["decode_tok_s"],
                None,
            ],
            [
                fmt,
                f"decode tok/s ({args.decode_len}, sampled)",
                ours["sampled_decode_tok_s"],
                f"{ours['sampled_decode_tok_s'] / ours['decode_tok_s']:.0%} of greedy",
                None,
                None,
            ],
        ]
    first = {**_format_kwargs(formats[0]), "kv_cache_dtype": kv_dtype}
    kv_context = getattr(args, "kv_context", 0)
    if kv_context:
        kv = off_main_thread(
            measure_kv, model_path, {**first, "max_total_tokens": kv_context + 64}, kv_context
        )
        results["kv"] = kv
        rows.append(
            [
                formats[0],
                "KV bytes/token of context",
                kv["held_bytes_per_token"],
                f"{kv['share_of_full_attention']:.0%} of full attention at {kv['context']}",
                None,
                None,
            ]
        )
    llama = (
        measure_llama_cpp(model_path, args.prompt_len, args.decode_len, repeats)
        if args.llama_cpp
        else None
    )
    if llama is not None:
        results["llama_cpp"] = llama
        # against plait on the file's own weights, dequantized exactly (llama.cpp reads them as
        # they are; plait's int8/int4 re-quantize the types its kernels do not read)
        agree = off_main_thread(
            llama_cpp_agreement,
            model_path,
            {"dtype": "float32", "kv_cache_dtype": kv_dtype, "max_total_tokens": 2048},
            torch.get_num_threads(),
        )
        llama["agreement_with_plait"] = agree
        rows += [
            [
                "llama.cpp (gguf)",
                f"prefill tok/s ({args.prompt_len})",
                llama["prefill_tok_s"],
                None,
                None,
                None,
            ],
            [
                "llama.cpp (gguf)",
                f"decode tok/s ({args.decode_len})",
                llama["decode_tok_s"],
                None,
                None,
                None,
            ],
        ]
        if agree is not None:
            rows.append(
                [
                    "llama.cpp vs float32",
                    "median |Δ logprob| (top-1 agreement)",
                    agree["median_abs_logprob_delta"],
                    f"{agree['top1_agreement']:.1%} top-1",
                    None,
                    None,
                ]
            )
    return results, rows


def run_latency_bench(args: argparse.Namespace) -> int:
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in FORMATS:
            raise SystemExit(f"--formats: unknown format {f!r} (choose from {', '.join(FORMATS)})")
    models = [m.strip() for m in (getattr(args, "models", None) or "").split(",") if m.strip()]
    models = models or [args.model_path]
    repeats = getattr(args, "repeats", 3)
    from plait.runtime.engine import off_main_thread

    # NOTE: off the main thread, so that its OpenMP team does not linger and throttle the engine's
    # (see `off_main_thread`), which would slow plait's decode in every run that follows.
    bandwidth = off_main_thread(measure_bandwidth)
    matmul_flops = off_main_thread(measure_matmul_flops)
    reports = {}
    for model in models:
        label = model or "default"
        reports[label] = bench_model(args, model, formats, repeats, bandwidth, matmul_flops)
    results, _ = reports[models[0] or "default"]
    for label, (_, model_rows) in reports.items():
        if len(reports) > 1:
            print(f"\nmodel {label}")
        print_table(
            ["format", "metric", "plait", "vs limit", "transformers", "perplexity"], model_rows
        )
    if len(reports) > 1:
        print_side_by_side(reports)
    print()
    weights_read = ", ".join(
        f"{fmt} {r['plait']['weight_bytes'] / r['plait']['weights_read_s'] / 1e9:.1f}"
        for fmt, r in results.items()
        if fmt in FORMATS and r["plait"]["weights_read_s"]
    )
    print(
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s (1 GiB probe; the weights themselves read at "
        f"GB/s: {weights_read or '-'}), float32 matmul {matmul_flops / 1e9:.0f} GFLOP/s, "
        f"{torch.get_num_threads()} threads, native kernels {native_isa()}"
        f"{f', bfloat16 prefill GEMM ({cpu_kind()})' if bf16_gemm_enabled() else ''}, "
        f"{cpu_model()}"
    )
    write_json(
        args.output,
        {
            "benchmark": "latency",
            "prompt_len": args.prompt_len,
            "decode_len": args.decode_len,
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
            "bandwidth_bytes_s": bandwidth,
            "matmul_flops": matmul_flops,
            "torch_threads": torch.get_num_threads(),
            "results": results,  # the first model's, as a one-model run writes them
            "models": {label: r for label, (r, _) in reports.items()},
        },
    )
    return 0


def print_side_by_side(reports: dict[str, tuple[dict[str, Any], list[list[Any]]]]) -> None:
    """Each model's rows as a column: the same metric in the same format side by side."""
    labels = list(reports)
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for label, (_, rows) in reports.items():
        for row in rows:
            table.setdefault((row[0], row[1]), {})[label] = row[2]
    print()
    print_table(
        ["format", "metric", *labels],
        [
            [fmt, metric, *(values.get(m) for m in labels)]
            for (fmt, metric), values in table.items()
        ],
    )
