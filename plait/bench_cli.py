"""`plait bench`: the benchmark workloads' command lines (each prints a table and writes JSON; the
workloads live in `plait.benchmarks`)."""

from __future__ import annotations

import argparse
from typing import Any

from plait.runtime.config_flags import add_engine_args

# workload -> (module of plait.benchmarks, its entry point)
WORKLOADS = {
    "latency": ("latency", "run_latency_bench"),
    "throughput": ("throughput", "run_throughput_bench"),
    "serving": ("serving", "run_serving_bench"),
    "programs": ("programs", "run_programs_bench"),
    "speculative": ("speculative", "run_speculative_bench"),
    "kv-tiers": ("kv_tiers", "run_kv_tiers_bench"),
    "json": ("json_bench", "run_json_bench"),
    "healing": ("healing_bench", "run_healing_bench"),
    "jsonschema": ("jsonschema_bench", "run_jsonschema_bench"),
    "pd": ("prefill_decode", "run_prefill_decode_bench"),
    "data-parallel": ("data_parallel", "run_data_parallel_bench"),
    "kernels": ("kernels", "run_kernels_bench"),
    "overhead": ("overhead", "run_overhead_bench"),
    "dashboard": ("dashboard", "run_dashboard_bench"),
    "llama-cpp": ("llama_cpp", "run_llama_cpp_bench"),
}


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    if args.workload not in WORKLOADS:
        raise SystemExit(f"plait bench: unknown workload {args.workload!r}")
    module, entry = WORKLOADS[args.workload]
    code = getattr(importlib.import_module(f"plait.benchmarks.{module}"), entry)(args)
    if code == 0 and getattr(args, "plot", None):
        from plait.benchmarks.plots import plot_file

        plot_file(args.output, args.plot, args.workload)
    return code


def add_bench_parser(sub: Any) -> None:
    """`plait bench <workload>` under the command line's subcommands `sub`."""
    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bench_sub = bench.add_subparsers(dest="workload", required=True)
    lat = bench_sub.add_parser("latency", help="prefill and single-stream decode vs transformers")
    lat.add_argument(
        "--formats",
        default="float32,int4",
        help="comma-separated: float32, bfloat16 (dtypes: blocks dequantized), native (blocks as "
        "stored), int8, int4 (weight-only quantization), deterministic (native, batch-invariant)",
    )
    lat.add_argument(
        "--no-llama-cpp",
        dest="llama_cpp",
        action="store_false",
        help="skip llama-cpp-python even when installed",
    )
    lat.add_argument(
        "--prompt-len", dest="prompt_len", type=int, default=512, help="prompt tokens prefilled"
    )
    lat.add_argument(
        "--decode-len", dest="decode_len", type=int, default=128, help="tokens decoded"
    )
    lat.add_argument(
        "--repeats", type=int, default=5, help="measurements per figure (the median is kept)"
    )
    lat.add_argument(
        "--output", default="bench-results/latency.json", help="JSON file of the results"
    )
    lat.add_argument(
        "--models",
        default=None,
        help="comma-separated models to run one after the other and show side by side (paths "
        "or package names, e.g. smollm2,gemma3-270m; default: --model alone)",
    )
    lat.add_argument(
        "--kv-context",
        dest="kv_context",
        type=int,
        default=8192,
        help="the context whose KV bytes per token are measured (capped by the model's; 0: skip)",
    )
    thr = bench_sub.add_parser(
        "throughput", help="continuous batching and the radix cache under load"
    )
    thr.add_argument(
        "--num-requests", dest="num_requests", type=int, default=64, help="requests per run"
    )
    thr.add_argument(
        "--min-prompt-len",
        dest="min_prompt_len",
        type=int,
        default=64,
        help="shortest random prompt, tokens",
    )
    thr.add_argument(
        "--max-prompt-len",
        dest="max_prompt_len",
        type=int,
        default=512,
        help="longest random prompt, tokens",
    )
    thr.add_argument(
        "--output-len",
        dest="output_len",
        type=int,
        default=128,
        help="tokens generated per request",
    )
    thr.add_argument("--concurrency", default="1,8,32", help="comma-separated client concurrencies")
    thr.add_argument(
        "--batch-sizes", dest="batch_sizes", default="8,32", help="transformers static batches"
    )
    thr.add_argument(
        "--prefix-len",
        dest="prefix_len",
        type=int,
        default=1000,
        help="shared-prefix run: prefix tokens",
    )
    thr.add_argument(
        "--shared-output-len",
        dest="shared_output_len",
        type=int,
        default=16,
        help="shared-prefix run: tokens generated per question",
    )
    thr.add_argument(
        "--shared-concurrency",
        dest="shared_concurrency",
        type=int,
        default=8,
        help="shared-prefix run: client concurrency",
    )
    thr.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (plait and transformers)"
    )
    thr.add_argument(
        "--top-p",
        dest="top_p",
        type=float,
        default=1.0,
        help="nucleus sampling (with --temperature)",
    )
    thr.add_argument(
        "--output", default="bench-results/throughput.json", help="JSON file of the results"
    )
    js = bench_sub.add_parser("json", help="JSON-schema extraction: jump-forward on/off, mask cost")
    js.add_argument(
        "--num-requests",
        dest="num_requests",
        default="1,8,32",
        help="comma-separated request counts, one batch each",
    )
    js.add_argument(
        "--max-new-tokens",
        dest="max_new_tokens",
        type=int,
        default=160,
        help="token budget per extraction",
    )
    js.add_argument(
        "--mask-batch",
        dest="mask_batch",
        type=int,
        default=16,
        help="rows of the mask-cost measurement",
    )
    js.add_argument(
        "--spacings",
        default="conventional,compact",
        help="JSON spacings to compare (json_whitespace), comma-separated",
    )
    js.add_argument("--output", default="bench-results/json.json", help="JSON file of the results")
    jsb = bench_sub.add_parser(
        "jsonschema",
        help="coverage and compliance on a JSONSchemaBench sample, per grammar backend",
    )
    from plait.benchmarks.jsonschema_bench import add_arguments as jsonschema_arguments

    jsonschema_arguments(jsb)
    add_engine_args(jsb)
    jsb.set_defaults(func=_cmd_bench)
    heal = bench_sub.add_parser("healing", help="few-shot accuracy with token healing on and off")
    heal.add_argument(
        "--output", default="bench-results/healing.json", help="JSON file of the results"
    )
    add_engine_args(heal)
    heal.set_defaults(func=_cmd_bench)
    spec = bench_sub.add_parser("speculative", help="decode speed with each drafter vs none")
    spec.add_argument(
        "--algorithms", default="ngram,self", help="comma-separated drafters to compare"
    )
    spec.add_argument(
        "--batch-sizes", dest="batch_sizes", default="1,8", help="comma-separated; one run each"
    )
    spec.add_argument(
        "--num-prompts",
        dest="num_prompts",
        type=int,
        default=8,
        help="prompts per workload (at least the batch size)",
    )
    spec.add_argument(
        "--max-new-tokens",
        dest="max_new_tokens",
        type=int,
        default=96,
        help="tokens generated per prompt",
    )
    spec.add_argument("--rounds", type=int, default=2, help="alternating passes per engine, pooled")
    spec.add_argument(
        "--output", default="bench-results/speculative.json", help="JSON file of the results"
    )
    from plait.benchmarks.programs import add_programs_args

    prog = bench_sub.add_parser(
        "programs", help="few-shot select, tree of thought, agent: cache on/off vs transformers"
    )
    add_programs_args(prog)
    add_engine_args(prog)
    prog.set_defaults(func=_cmd_bench)
    from plait.benchmarks.data_parallel import add_data_parallel_args

    dp = bench_sub.add_parser(
        "data-parallel", help="shared prefixes over 2 replicas: cache-aware vs round-robin vs DP=1"
    )
    add_data_parallel_args(dp)
    dp.set_defaults(func=_cmd_bench)
    from plait.benchmarks.prefill_decode import add_prefill_decode_args

    pd = bench_sub.add_parser(
        "pd", help="prefill-decode disaggregation vs colocated: ITL while long prompts arrive"
    )
    add_prefill_decode_args(pd)
    pd.set_defaults(func=_cmd_bench)
    from plait.benchmarks.kv_tiers import add_kv_tiers_args

    kvt = bench_sub.add_parser(
        "kv-tiers", help="the disk tier: restart TTFT warm vs cold, a working set beyond the pool"
    )
    add_kv_tiers_args(kvt)
    kvt.set_defaults(func=_cmd_bench)
    from plait.benchmarks.serving import add_serving_args

    srv = bench_sub.add_parser(
        "serving", help="load-test a running server (plait, SGLang, llama.cpp, vLLM)"
    )
    add_serving_args(srv)
    srv.set_defaults(func=_cmd_bench)
    from plait.benchmarks.llama_cpp import add_llama_cpp_args
    from plait.benchmarks.overhead import add_overhead_args

    over = bench_sub.add_parser(
        "overhead", help="the share of a decode step that is not arithmetic"
    )
    add_overhead_args(over)
    over.add_argument(
        "--model",
        "--model-path",
        dest="model_path",
        default=None,
        help="a .gguf file or a Hugging Face folder (default: the embedded model)",
    )
    over.set_defaults(func=_cmd_bench)
    from plait.benchmarks.kernels import add_kernels_args

    kern = bench_sub.add_parser(
        "kernels", help="the quantized matmul's GFLOP/s per block type and batch size"
    )
    add_kernels_args(kern)
    kern.set_defaults(func=_cmd_bench)

    from plait.benchmarks.dashboard import add_dashboard_args

    dash = bench_sub.add_parser("dashboard", help="what watching /dashboard costs a decode step")
    add_dashboard_args(dash)
    add_engine_args(dash)
    dash.set_defaults(func=_cmd_bench)
    lcpp = bench_sub.add_parser(
        "llama-cpp", help="plait's server beside llama.cpp's on the same GGUF"
    )
    add_llama_cpp_args(lcpp)
    add_engine_args(lcpp)
    lcpp.set_defaults(func=_cmd_bench)
    for p in (lat, thr, js, spec):
        p.add_argument(
            "--no-transformers",
            dest="transformers",
            action="store_false",
            help="skip the transformers baseline",
        )
        add_engine_args(p)
        p.set_defaults(func=_cmd_bench)
    for p in bench_sub.choices.values():
        p.add_argument(
            "--plot",
            metavar="DIR",
            default=None,
            help="also write figures of the results into DIR (needs plait[bench]; default: none)",
        )
