"""docs/results.md, written from the JSON reports of the benchmarks in `benchmarks/results/`.

    plait bench latency --models smollm2,gemma3-270m --formats float32,native,int4 \
        --kv-context 8192 --decode-len 128 --repeats 3 --output benchmarks/results/latency.json
    ...
    python -m plait.benchmarks.results_page --plots   # draws the figures, rewrites docs/results.md
    python -m plait.benchmarks.results_page --check   # exits 1 where the page is out of date

Every figure on the page comes from a report; each section names the command, the date and the
machine that produced it. A test runs `--check`, so the page cannot drift from the reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
PAGE = ROOT / "docs" / "results.md"
IMAGES = ROOT / "docs" / "images" / "results"

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


def jsonschema(r: Report) -> list[str]:
    n = r["num_schemas"]
    cover, outcome, speed = [], [], []
    for name, b in r["backends"].items():
        cover.append(
            [
                name,
                f"{round(b['coverage'] * n)}/{n}",
                b["compile_p50_ms"],
                b["compile_p99_ms"],
                b["mask_mean_us"],
                b["mask_p99_us"],
            ]
        )
        for budget, c in b["by_budget"].items():
            outcome.append(
                [
                    name,
                    budget,
                    f"**{c['valid'] + c['closed_valid']}/{n}**",
                    c["closed_valid"],
                    c["finished_invalid"],
                    c["closed_invalid"],
                    c["truncated"],
                ]
            )
        for key, value in b.items():
            if key.startswith("decode_") and isinstance(value, dict):
                schema, _, batch = key.removeprefix("decode_").rpartition("_")
                speed.append(
                    [
                        name,
                        f"{schema or 'strings'}, {batch[1:]}",
                        value["free"],
                        value["constrained"],
                        pct(value["constrained"] / value["free"]),
                    ]
                )
    lc = r.get("llama.cpp")
    if lc:
        cover.append(
            ["llama.cpp's server", f"{round(lc['coverage'] * n)}/{n}", None, None, None, None]
        )
        for budget, c in lc["by_budget"].items():
            outcome.append(
                [
                    "llama.cpp's server",
                    budget,
                    f"**{c['valid']}/{n}**",
                    None,
                    c["finished_invalid"],
                    None,
                    c["truncated"],
                ]
            )
    lines = [
        f"{n} schemas of [JSONSchemaBench](https://github.com/guidance-ai/jsonschemabench) "
        f"({r['per_category']} per category, seed {r['seed']}), one greedy request each; every "
        f"output validated against its schema with `jsonschema` (formats checked).",
        "",
        *table(
            [
                "backend",
                "covered",
                "compile p50 ms",
                "compile p99 ms",
                "mask mean µs",
                "mask p99 µs",
            ],
            cover,
        ),
        *table(
            [
                "backend",
                "max_tokens",
                "valid",
                "of which closed early",
                "finished invalid",
                "closed invalid",
                "truncated",
            ],
            outcome,
        ),
    ]
    if lc:
        lines += [
            "llama.cpp's server (llama-cpp-python, same GGUF, one request at a time) falls back "
            "to any-JSON output where it cannot convert a schema; its `covered` counts the "
            "schemas its converter takes, its `valid` every valid output.",
            "",
        ]
        lost = [
            f"{c.get('crashed', 0)} crashed its server and {c.get('failed', 0)} failed at "
            f"{budget} tokens"
            for budget, c in lc["by_budget"].items()
            if c.get("crashed") or c.get("failed")
        ]
        if lost:
            lines[-2] += (
                f" Of its requests, {'; '.join(lost)} (a segmentation fault; the "
                "benchmark starts a new server; a failed request is one sent while it was "
                "down or past the timeout)."
            )
    if speed:
        lines += [
            "Decode speed under a schema against free decoding of as many tokens (`strings`: a "
            "list of bounded strings; `records`: objects with forced keys):",
            "",
            *table(["backend", "schema, batch", "free tok/s", "constrained tok/s", "ratio"], speed),
        ]
    return lines


def json_extraction(r: Report) -> list[str]:
    res = r["results"]
    runs = {k: v for k, v in res.items() if isinstance(v, dict) and "seconds" in v}
    off = runs.get("jump-forward off")
    rows = [
        [
            name,
            v["output_tokens"] / v["seconds"],
            times(off["seconds"] / v["seconds"]) if off else "",
            v["jump_forward_tokens"],
            v["valid_json"],
        ]
        for name, v in runs.items()
    ]
    lines = ["Extraction requests under an 8-field schema, greedy, in one batch.", ""]
    if res.get("by_requests"):
        lines += [
            "Jump-forward on against off by request count: cold, every prompt prefilled; warm, the "
            "prompts already in the prefix cache, so the run is decoding alone.",
            "",
            *table(
                ["requests", "× cold", "× warm", "tokens jumped"],
                [
                    [
                        n,
                        times(e["speedup_cold"]),
                        times(e["speedup_warm"]),
                        f"{e['jump-forward on']['cold']['jump_forward_tokens']} of "
                        f"{e['jump-forward on']['cold']['output_tokens']}",
                    ]
                    for n, e in res["by_requests"].items()
                ],
            ),
        ]
    lines += [
        "The largest count, cold, beside unconstrained generation of the same lengths:",
        "",
        *table(["run", "output tok/s", "× jump-forward off", "tokens jumped", "valid JSON"], rows),
    ]
    if res.get("spacing"):
        rows = []
        for spacing, e in res["spacing"].items():
            a = e["accuracy"]
            rows.append(
                [
                    spacing,
                    f"{a['ages_right']}/{a['of']}",
                    f"{a['names_right']}/{a['of']}",
                    f"{a['cities_right']}/{a['of']}",
                    times(e["jf_off_s"] / e["jf_on_s"]),
                    f"{e['jumped']} of {e['output_tokens']}",
                ]
            )
        lines += [
            "By JSON spacing (`json_whitespace`): name, age and city extracted from twelve short "
            "paragraphs and checked against them; jump-forward's speedup on the largest "
            "count, cold.",
            "",
            *table(
                [
                    "spacing",
                    "ages right",
                    "names right",
                    "cities right",
                    "JF speedup",
                    "tokens jumped",
                ],
                rows,
            ),
        ]
    if "steps" in res and "mask" in res:
        st, m = res["steps"], res["mask"]
        lines += [
            f"A constrained decode step (jump-forward off) took "
            f"{st['constrained_step_ms']:.1f} ms against "
            f"{st['unconstrained_step_ms']:.1f} ms unconstrained "
            f"({st['constrained_step_overhead']:+.1%}); "
            f"a mask filled in {m['fill_us_mean']:.0f} µs per token "
            f"(P99 {m['fill_us_p99']:.0f} µs).",
            "",
        ]
    return lines


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
        "GFLOP/s (2 M N K per product): `quant_matmul` (its path: the integer kernels or the "
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


# the page --------------------------------------------------------------------------------------

# (report file, heading, renderer, its figures in IMAGES as `plots.py` names them), in page order
SECTIONS: list[tuple[str, str, Callable[[Report], list[str]], str]] = [
    ("latency.json", "Single stream: prefill, decode, perplexity", latency, "latency-*.png"),
    ("throughput.json", "Continuous batching and the radix cache", throughput, "throughput-*.png"),
    ("llama_cpp.json", "Serving beside llama.cpp's server", llama_cpp, "llama-cpp-*.png"),
    ("speculative.json", "Speculative decoding", speculative, "speculative*.png"),
    ("jsonschema.json", "Structured output on real-world schemas", jsonschema, "jsonschema-*.png"),
    ("json.json", "JSON extraction: jump-forward", json_extraction, "json-*.png"),
    ("pd.json", "Prefill–decode disaggregation", prefill_decode, "pd-*.png"),
    ("kernels.json", "The quantized matmul by block type and rows of x", kernels, "kernels-*.png"),
]


def machine_line(m: dict[str, Any]) -> str:
    parts = [f"{m.get('cpu', '?')}, {m.get('cpus', '?')} cores"]
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']:.0f} GiB")
    parts.append(f"native kernels `{m.get('native_isa', '?')}`")
    if m.get("bf16_prefill_gemm"):
        parts.append(f"bfloat16 prefill GEMM ({m.get('cpu_kind', 'AMX')})")
    parts.append(f"torch {m.get('torch', '?')}, {m.get('torch_threads', '?')} threads")
    return ", ".join(parts)


def render(results: Path = RESULTS, images: Path = IMAGES) -> str:
    found = [
        (f, h, fn, figures, json.loads((results / f).read_text()))
        for f, h, fn, figures in SECTIONS
        if (results / f).is_file()
    ]
    machines = sorted({machine_line(rep.get("machine", {})) for *_, rep in found})
    lines = [
        "# Results",
        "",
        "<!-- generated by `python -m plait.benchmarks.results_page` from "
        "benchmarks/results/*.json -->",
        "",
        "The latest figures of each `plait bench …` command, written from the JSON report it wrote "
        "(`benchmarks/results/`). How to run the benchmarks and read them: "
        "[benchmarks.md](benchmarks.md). The figures are for the embedded model, "
        "SmolLM2-135M-Instruct (int4 and int8: the GGUF's Q4_1 blocks; float32: the same file "
        "dequantized), unless a section names another (Gemma 3 270M, Q4_K_M).",
        "",
        "Measured on " + ("; ".join(machines) if machines else "no machine yet (no reports)") + ".",
        "",
    ]
    for name, heading, fn, figures, rep in found:
        lines += [f"## {heading}", ""]
        command = rep.get("command") or f"plait bench … (`{name}`)"
        lines += [f"`{command}`, {rep.get('date', 'undated')}.", ""]
        if len(machines) > 1:
            lines += [f"Machine: {machine_line(rep.get('machine', {}))}.", ""]
        lines += fn(rep)
        for figure in sorted(images.glob(figures)):
            rel = figure.relative_to(PAGE.parent) if figure.is_relative_to(PAGE.parent) else figure
            lines += [f"![{figure.stem}]({rel.as_posix()})", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of JSON reports")
    parser.add_argument("--out", type=Path, default=PAGE)
    parser.add_argument(
        "--images", type=Path, default=IMAGES, help="the folder of the reports' figures"
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if --out differs from the reports"
    )
    parser.add_argument(
        "--plots", action="store_true", help="first draw each report's figures (matplotlib)"
    )
    args = parser.parse_args(argv)
    if args.plots:
        from plait.benchmarks.plots import plot_file

        for f, *_ in SECTIONS:
            if (args.results / f).is_file():
                plot_file(str(args.results / f), str(args.images))
    text = render(args.results, args.images)
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(
                f"{args.out} is out of date: python -m plait.benchmarks.results_page",
                file=sys.stderr,
            )
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
