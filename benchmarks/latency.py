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
VM's memory drifts by tens of percent within seconds), in parentheses the share of the roofline by
a fixed 1 GiB probe (which read 47 or 75 GB/s on the same VM depending on its allocation, and often
slower than the weights themselves), the
prefill's share of the measured float32 matmul rate (its FLOPs: the projections' 2 per weight
per token, plus causal attention's 2 * layers * heads * head_dim * T^2), and the perplexity of the
second half of a fixed text, computed over its first half read back from the KV cache (so that the
cache's storage format counts). transformers runs the float dtypes on the same weights;
llama-cpp-python (if installed: `make bench-deps`) runs the GGUF file itself once, with the same
thread count. `--kv-cache-dtype` stores plait's KV cache as bfloat16 or int8 (the perplexity
column shows what that costs). Everything runs in one process, one after the other.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

import torch

from plait.benchmarks.common import best_of, check_decoded, cpu_model, print_table, write_json
from plait.kernels.quant_matmul import bf16_gemm_enabled, cpu_kind, native_isa
from plait.runtime.config_flags import engine_kwargs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FORMATS = ("float32", "bfloat16", "native", "int8", "int4", "deterministic")

PERPLEXITY_TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, and for ninety years its keepers "
    "had climbed the same hundred and twelve steps each evening to light the lamp. The last "
    "keeper, a quiet woman who had come to the island as a child, kept a logbook in which she "
    "wrote the weather, the ships that passed, and the birds that rested on the gallery rail. When "
    "the light was automated, she stayed on as a caretaker, painting the iron railings every "
    "spring and answering letters from people who remembered the sound of the foghorn. Scientists "
    "later used her logbooks to study how the migration of seabirds had shifted as the winters "
    "grew milder."
)


def _format_kwargs(fmt: str) -> dict:
    if fmt in ("int8", "int4"):
        return {"dtype": "float32", "quantization": fmt}
    if fmt == "native":  # the default: a GGUF's blocks as stored, the rest float32
        return {"dtype": "float32"}
    if fmt == "deterministic":  # the same weights, every step batch-invariant
        return {"dtype": "float32", "deterministic": True}
    return {"dtype": fmt, "quantization": "float32"}  # every block dequantized


# the sampled decode row: a typical chat setting, seeded
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "seed": 0}


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best time to sum a float32 tensor far larger than the
    caches."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    seconds = best_of(lambda: x.sum(), repeats)
    return x.numel() * 4 / seconds


def measure_weights_read(engine: Any, repeats: int = 5) -> float | None:
    """The best time to read the weights one decode step reads, where they lie (a plain streaming
    read on the engine's thread count), or None off the CPU or without the native kernels."""
    from plait.kernels.memory_read import read_seconds
    from plait.runtime.engine import off_main_thread
    from plait.runtime.models.quantized import weight_tensors

    tensors = [t.contiguous() for t in weight_tensors(engine.model)]
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return off_main_thread(read_seconds, tensors, repeats)


def roofline_steps_s(weights_read_s: float | None, bandwidth: float, weight_bytes: int) -> float:
    """Steps/s if a decode step only read its weights: at the pace those very bytes were read,
    else at the machine's measured bandwidth."""
    return 1.0 / weights_read_s if weights_read_s else bandwidth / weight_bytes


def measure_matmul_flops(repeats: int = 5) -> float:
    """float32 FLOP/s of a prefill-shaped matmul ([512, 576] x [576, 3072])."""
    a, b = torch.randn(512, 576), torch.randn(576, 3072)
    a @ b
    return 2 * 512 * 576 * 3072 / best_of(lambda: a @ b, repeats)


def _prompt_ids(tokenizer: Any, n: int) -> list[int]:
    text = (
        "The history of computing is a story of layers: each generation of machines hides the "
        "details of the one below it, and every abstraction costs a little speed. "
    )
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text)
    return ids[:n]


def measure_plait(
    model_path: str | None,
    fmt: str,
    prompt_len: int,
    decode_len: int,
    repeats: int,
    kv_cache_dtype: str = "auto",
    engine_args: dict | None = None,
) -> dict:
    """`engine_args`: the command's engine flags (`--cpu-threads`, `--page-size`, ...); the model,
    the format's dtype and quantization, the KV cache's dtype and the pool size are the bench's."""
    from plait.runtime.engine import Engine

    engine = Engine(
        **{
            **(engine_args or {}),
            "model_path": model_path,
            "max_total_tokens": max(prompt_len + decode_len + 64, 1024),
            "kv_cache_dtype": kv_cache_dtype,
            **_format_kwargs(fmt),
        }
    )
    try:
        ids = _prompt_ids(engine.tokenizer, prompt_len)
        prefill_only = {"max_new_tokens": 0}
        engine.generate(input_ids=ids[:32], sampling_params={"max_new_tokens": 2})  # warm up

        def prefill_once() -> None:
            engine.flush_cache()  # a cached prompt would skip the very prefill being timed
            engine.generate(input_ids=ids, sampling_params=prefill_only)

        prefill_s = best_of(prefill_once, repeats)
        decode_params = {"max_new_tokens": decode_len, "temperature": 0, "ignore_eos": True}

        def decode_once(params: dict = decode_params) -> float:
            first = last = None
            for chunk in engine.generate(input_ids=ids[:16], sampling_params=params, stream=True):
                last = chunk
                if first is None:
                    first = time.perf_counter()
            elapsed = time.perf_counter() - first
            check_decoded(last, decode_len)
            return (decode_len - 1) / elapsed

        # NOTE: a virtual machine's memory reads can drift by tens of percent within seconds, so
        # each decode run is paired with reads of the weights just before and after it, and its
        # share of the roofline is taken against the faster of the two.
        # The sampled runs alternate with the greedy ones, so that both see the same memory phases.
        decode_runs, read_runs, sampled_runs = [], [], []
        for _ in range(repeats):
            before = measure_weights_read(engine, 2)
            decode_runs.append(decode_once())
            after = measure_weights_read(engine, 2)
            read_runs.append(min(before, after) if before and after else None)
            sampled_runs.append(decode_once({**decode_params, **SAMPLED}))
        decode_tps, sampled_tps = max(decode_runs), max(sampled_runs)
        paired = sorted(tps * read_s for tps, read_s in zip(decode_runs, read_runs) if read_s)
        decode_share = paired[len(paired) // 2] if paired else None
        text_ids = engine.tokenizer.encode(PERPLEXITY_TEXT)
        half = len(text_ids) // 2
        engine.flush_cache()
        engine.generate(
            input_ids=text_ids[:half], sampling_params={"max_new_tokens": 0}
        )  # now cached
        out = engine.generate(
            input_ids=text_ids,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=half,
        )
        logprobs = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
        perplexity = float(torch.tensor(logprobs).neg().mean().exp())
        linear_params = sum(
            m.in_features * m.out_features
            for name, m in engine.model.named_modules()
            if hasattr(m, "in_features") and name != "lm_head"
        )
        stats = engine.stats()
        weight_bytes = stats["weight_bytes"]
        # what the engine chose at start: the paths these figures are of
        execution = {k.removeprefix("execution_"): v for k, v in stats.items() if "execution_" in k}
        reads = sorted(r for r in read_runs if r)
        weights_read_s = reads[len(reads) // 2] if reads else None
        a = engine.args  # causal attention: QK^T and PV over half the T x T scores, every head
        attention_flops = 2 * a.num_layers * a.num_heads * a.head_dim * prompt_len * prompt_len
    finally:
        engine.shutdown()
    return {
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": decode_tps,
        "sampled_decode_tok_s": sampled_tps,
        "weight_bytes": weight_bytes,
        "weights_read_s": weights_read_s,
        "decode_share_of_roofline": decode_share,
        "perplexity": perplexity,
        "prefill_flops_per_token": 2 * linear_params + attention_flops // prompt_len,
        "execution": execution,
    }


def measure_transformers(
    model_path: str | None, dtype: str, prompt_len: int, decode_len: int, repeats: int
) -> dict:
    from plait.runtime.thirdparty import import_transformers

    transformers = import_transformers()

    from plait.runtime.model_loader.locate import locate_checkpoint
    from plait.runtime.tokenizer import Tokenizer

    loc = locate_checkpoint(model_path)
    if loc.kind == "gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(loc.path), gguf_file=os.path.basename(loc.path), dtype=torch.float32
        )
        from plait.runtime.model_loader.gguf_file import read_gguf_metadata

        tokenizer = Tokenizer.from_gguf_metadata(read_gguf_metadata(loc.path))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(loc.path, dtype=torch.float32)
        tokenizer = Tokenizer.from_hf_dir(loc.path)
    model = model.to(_DTYPES[dtype]).eval()
    ids = torch.tensor([_prompt_ids(tokenizer, prompt_len)])
    short = ids[:, :16]
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model(ids[:, :32])
        prefill_s = best_of(lambda: model(ids, attention_mask=mask, use_cache=True), repeats)
        kwargs = dict(
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            attention_mask=torch.ones_like(short),
        )
        one = best_of(
            lambda: model.generate(short, max_new_tokens=1, min_new_tokens=1, **kwargs), repeats
        )
        full = best_of(
            lambda: model.generate(
                short, max_new_tokens=decode_len, min_new_tokens=decode_len, **kwargs
            ),
            repeats,
        )
    gc.collect()
    return {
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": (decode_len - 1) / (full - one),
    }


def measure_llama_cpp(
    model_path: str | None, prompt_len: int, decode_len: int, repeats: int
) -> dict | None:
    """llama-cpp-python on the same GGUF file and thread count, or None when not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from plait.runtime.model_loader.locate import locate_checkpoint

    loc = locate_checkpoint(model_path)
    if loc.kind != "gguf":
        return None
    from plait.benchmarks.llama_cpp import keep_llama_cpp_off_amx

    keep_llama_cpp_off_amx()
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(
        loc.path,
        n_ctx=prompt_len + decode_len + 64,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=prompt_len,
        verbose=False,
    )
    ids = llm.tokenize(PERPLEXITY_TEXT.encode())
    ids = (ids * (prompt_len // len(ids) + 1))[:prompt_len]

    def prefill_once() -> None:
        llm.reset()
        llm.eval(ids)

    prefill_s = best_of(prefill_once, repeats)

    def decode_once() -> float:
        llm.reset()
        llm.eval(ids[:16])
        start = time.perf_counter()
        for _ in range(decode_len):
            token = llm.sample(temp=0.0)
            llm.eval([token])
        return decode_len / (time.perf_counter() - start)

    decode_tps = max(decode_once() for _ in range(repeats))
    return {
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": decode_tps,
        "version": llama_cpp.__version__,
    }


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
    # (see `off_main_thread`): measured on the main thread, plait's decode here ran ~2x slower.
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
