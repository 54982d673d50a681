"""The sections of docs/results.md: one renderer per benchmark, from its JSON report to the lines
under the section's heading (the structured-output benchmarks' in `results_structured.py`), and
the table and number formats they share. `results_page.py` puts them in order on the page."""

from __future__ import annotations

from typing import Any

Report = dict[str, Any]


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value != value:  # NaN
            return ""
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def pct(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def times(value: float | None) -> str:
    return "" if value is None else f"**{value:.2f}×**"


# one renderer per benchmark: the report -> the section's lines after its heading ----------------


def latency(r: Report) -> list[str]:
    lines = [
        f"A {r['prompt_len']}-token prompt prefilled, then {r['decode_len']} tokens decoded "
        f"greedily (and once sampled: temperature 0.7, top-p 0.9), one request. The share of the "
        f"roofline is decode steps per second against a plain read of the weights a step reads, "
        f"measured beside each run; prefill against a float32 matmul's rate.",
        "",
    ]
    models = r.get("models") or {"": r["results"]}  # one table per model a run named
    for name, res in models.items():
        if name:
            lines += [f"**{name}**", ""]
        lines += _latency_table(res)
    return lines


def _latency_table(res: dict[str, Any]) -> list[str]:
    rows = []
    for fmt, entry in res.items():
        if fmt in ("llama_cpp", "kv"):
            continue
        ours = entry["plait"]
        share = (
            ours.get("decode_share_of_roofline") or ours["decode_tok_s"] / entry["roofline_steps_s"]
        )
        rows.append(
            [
                f"plait {fmt}",
                ours["prefill_tok_s"],
                pct(entry["prefill_share_of_matmul"]),
                ours["decode_tok_s"],
                pct(share),
                ours["sampled_decode_tok_s"],
                ours["perplexity"],
            ]
        )
        if entry.get("transformers"):
            ref = entry["transformers"]
            rows.append(
                [f"transformers {fmt}", ref["prefill_tok_s"], "", ref["decode_tok_s"], "", "", ""]
            )
    llama = res.get("llama_cpp")
    if llama:
        version = llama.get("version", "")
        rows.append(
            [f"llama.cpp {version} (same GGUF)", llama["prefill_tok_s"], "", llama["decode_tok_s"]]
            + [""] * 3
        )
    header = ["system", "prefill tok/s", "of matmul rate", "decode tok/s", "of roofline"]
    lines = [*table([*header, "sampled decode tok/s", "perplexity"], rows)]
    kv = res.get("kv")
    if kv:
        lines += [
            f"KV cache held per token of context at {kv['context']:,} tokens: "
            f"{kv['held_bytes_per_token']:,.0f} bytes, {pct(kv['share_of_full_attention'])} of "
            "what full attention would hold.",
            "",
        ]
    ours_fmt = next((f for f in ("native", "int4") if f in res), None)
    if llama and ours_fmt:
        ours = res[ours_fmt]["plait"]
        lines += [
            f"plait {ours_fmt} against llama.cpp: "
            f"prefill {times(ours['prefill_tok_s'] / llama['prefill_tok_s'])}, "
            f"decode {times(ours['decode_tok_s'] / llama['decode_tok_s'])}.",
            "",
        ]
    agreement = (llama or {}).get("agreement_with_plait")
    if agreement:
        lines += [
            f"llama.cpp's next-token logprobs against plait's float32 model over "
            f"{agreement['positions']} positions: median |Δ| "
            f"{agreement['median_abs_logprob_delta']:.3f}, top-1 agreement "
            f"{pct(agreement['top1_agreement'])}.",
            "",
        ]
    return lines


def throughput(r: Report) -> list[str]:
    a, res = r["args"], r["results"]
    single = res["random"][0]["output_tok_s"]
    rows = [
        [
            c["concurrency"],
            c["output_tok_s"],
            f"{c['output_tok_s'] / single:.2f}×",
            c["steps_s"],
            pct(c["steps_s"] / r["roofline_steps_s"]),
            c["ttft_mean_s"],
            c["ttft_p99_s"],
        ]
        for c in res["random"]
    ]
    lines = [
        f"{a['num_requests']} random prompts of {a['min_prompt_len']}–{a['max_prompt_len']} "
        f"tokens, {a['output_len']} tokens out each, offered by that many concurrent clients; "
        f"quantization {a.get('quantization')}. Decode steps per second against the roofline of "
        f"{r['roofline_steps_s']:.0f} steps/s (one read of the weights per step).",
        "",
        *table(
            [
                "concurrency",
                "output tok/s",
                "× concurrency 1",
                "steps/s",
                "of roofline",
                "TTFT mean s",
                "TTFT P99 s",
            ],
            rows,
        ),
    ]
    if res.get("decode"):
        peak = r.get("int8_macs_s")
        lines += [
            "The decode step alone at each batch (16-token prompts, cached): weight multiply-adds "
            "per second against the int8 dot products' peak measured in the same run"
            + (f", {peak / 1e9:.0f} GMAC/s" if peak else "")
            + " (two-level activations take two of those per weight multiply-add, so half the "
            "peak bounds the kernels).",
            "",
            *table(
                ["batch", "step ms", "decode tok/s", "weight GMAC/s", "of int8 peak"],
                [
                    [
                        d["batch"],
                        d["step_s"] * 1e3,
                        d["batch"] / d["step_s"] if d["step_s"] else None,
                        d["weight_macs_s"] / 1e9 if d["weight_macs_s"] else None,
                        pct(d["weight_macs_s"] / peak) if peak and d["weight_macs_s"] else None,
                    ]
                    for d in res["decode"]
                ],
            ),
        ]
    if res.get("transformers"):
        lines += table(
            ["transformers static batch", "output tok/s"],
            [[t["batch_size"], t["output_tok_s"]] for t in res["transformers"]],
        )
    shared = {s["cache"]: s for s in res.get("shared_prefix", [])}
    if "on" in shared and "off" in shared:
        on, off = shared["on"], shared["off"]
        lines += [
            f"A {a['prefix_len']}-token shared prefix before {a['num_requests']} questions "
            f"({a['shared_output_len']} tokens out, concurrency {a['shared_concurrency']}): "
            f"{on['seconds']:.1f} s with the radix cache (hit rate {on['cache_hit_rate']:.0%}), "
            f"{off['seconds']:.1f} s without, {times(off['seconds'] / on['seconds'])}.",
            "",
        ]
    return lines


def speculative(r: Report) -> list[str]:
    rows = [
        [
            x["workload"],
            x["batch"],
            x["algorithm"],
            x["decode_tok_s"],
            times(x.get("speedup")),
            x["mean_accept_length"],
            pct(x["acceptance_rate"]),
        ]
        for x in r["results"]
    ]
    return [
        f"Greedy decoding of the same prompts with each drafter and without (`none`), the engines "
        f"taking turns batch by batch over {r['rounds']} alternating rounds. Extractive prompts "
        f"ask for text the prompt already holds; chat prompts do not.",
        "",
        *table(
            [
                "workload",
                "batch",
                "drafter",
                "decode tok/s",
                "× none",
                "mean accepted length",
                "acceptance rate",
            ],
            rows,
        ),
    ]


def llama_cpp(r: Report) -> list[str]:
    by = {(x["server"], x["concurrency"]): x for x in r["results"]}
    rows = []
    for level in sorted({x["concurrency"] for x in r["results"]}):
        ours, ref = by.get(("plait", level)), by.get(("llama.cpp", level))
        if not ours:
            continue
        ratio = ours["output_tok_s"] / ref["output_tok_s"] if ref and ref["output_tok_s"] else None
        rows.append(
            [
                level,
                ours["output_tok_s"],
                ref and ref["output_tok_s"],
                times(ratio),
                ours["ttft_ms"]["median"],
                ref and ref["ttft_ms"]["median"],
                ours["itl_ms"]["median"],
                pct(ours.get("spaced_events_per_token")),
            ]
        )
    flags = " ".join(r.get("engine_flags") or []) or "defaults"
    return [
        f"`plait serve` ({flags}) and llama-cpp-python's server one after the other on the same "
        f"GGUF and {r['threads']} threads, streaming `/v1/completions`; llama-cpp-python's server "
        f"answers one request at a time. Tokens streamed apart: the share of plait's output tokens "
        f"that reached the client as an event of their own.",
        "",
        *table(
            [
                "concurrency",
                "plait output tok/s",
                "llama.cpp output tok/s",
                "plait / llama.cpp",
                "plait TTFT median ms",
                "llama.cpp TTFT median ms",
                "plait ITL median ms",
                "plait tokens streamed apart",
            ],
            rows,
        ),
    ]


PD_HEADERS = [
    "setup",
    "replicas",
    "threads",
    "output tok/s",
    "TTFT p50 ms",
    "ITL p50 ms",
    "ITL p99 ms",
    "ITL p99 during long prefills ms",
    "long TTFT p50 ms",
    "KV MB per long prompt",
    "push ms",
    "prefill ms",
    "failed",
]


def prefill_decode(r: Report) -> list[str]:
    c, runs = r["config"], r["runs"]
    cpus = r.get("machine", {}).get("cpus")
    rows = []
    for name, x in runs.items():
        t = x.get("transfer")
        threads = f"{cpus // x['replicas']} each" if cpus and x["replicas"] > 1 else cpus
        rows.append(
            [
                name,
                x["replicas"],
                threads,
                x["output_tok_s"],
                x["short_ttft_ms"]["p50"],
                x["itl_ms"]["p50"],
                x["itl_ms"]["p99"],
                x["itl_during_long_prefill_ms"]["p99"],
                x["long_ttft_ms"]["p50"],
                t and t["bytes"] / 1e6,
                t and t["push_ms"],
                t and t["prefill_ms"],
                len(x["failed"]),
            ]
        )
    return [
        f"{c['streams']} streams of short requests ({c['short_len']} words in, "
        f"{c['output_len']} tokens out, greedy) decode without pause while {c['num_long']} long "
        f"prompts of {c['long_len']} words ({c['long_output']} tokens out) arrive "
        f"{c['long_interval']:g} s apart, through the router; quantization "
        f"{c.get('quantization')}. `colocated`: one replica on every core; `chunked`: the same, "
        f"prefilling in chunks of 256 tokens; `pd`: a prefill and a decode replica, the cores "
        f"split between them; `pd-long`: the same, short prompts prefilled where they decode. "
        f"ITL during long prefills counts the gaps that overlap a long prompt's wait for its first "
        f"token. KV per long prompt: bytes, push and prefill milliseconds of long prompts sent "
        f"alone after the load.",
        "",
        *table(PD_HEADERS, rows),
    ]


def kernels(r: Report) -> list[str]:
    shape, rows = r["shape"], []
    for x in r["results"]:
        before, direct = x.get("compared_gflops"), x.get("direct_gflops")
        rows.append(
            [
                x["block_type"],
                x["m"],
                x["gflops"],
                x.get("path", "-"),
                direct,
                before,
                times(direct / before) if direct and before else "-",
                x["torch_float32_gflops"],
                x["torch_bfloat16_gflops"],
                x["memory_roof_gflops"],
            ]
        )
    compared = r.get("compare_library")
    return [
        f"One [M, {shape['k']}] x [{shape['n']}, {shape['k']}] product per block type and M, "
        "GFLOP/s (2 M N K per product): `quant_matmul` (its path, `QuantMatmul.path`: the integer "
        "kernels on int8 x, the float tiles, torch's GEMM on the dequantized matrix or the "
        "bfloat16 GEMM), "
        f"the integer kernels alone called straight through ctypes"
        + (f", and the same call on another build (`{compared}`)" if compared else "")
        + "; torch's float32 and bfloat16 `F.linear` on the same shape, and the memory roof (a "
        "plain read of the block type's bytes). float32 GEMM peak (2048³): "
        f"{r['float32_peak_gflops']:.0f} GFLOP/s.",
        "",
        *table(
            [
                "block type",
                "M",
                "GFLOP/s",
                "path",
                "integer kernels",
                "other build",
                "×",
                "torch float32",
                "torch bfloat16",
                "memory roof",
            ],
            rows,
        ),
    ]
