"""The `plait` command line: `plait generate`, `plait bench`. Only this module reads argv."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from plait.runtime.config_flags import Parser, add_engine_args, engine_kwargs


def _cmd_generate(args: argparse.Namespace) -> int:
    from plait.runtime.engine import Engine

    engine = Engine(**engine_kwargs(args))
    try:
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        params = {"max_new_tokens": args.max_tokens, "temperature": args.temperature}
        if args.seed is not None:
            params["seed"] = args.seed
        printed = 0
        for chunk in engine.generate(prompt, sampling_params=params, stream=True):
            text = chunk["text"]
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
        sys.stdout.write("\n")
    finally:
        engine.shutdown()
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """Runs a Python file with the default backend set to an in-process Runtime."""
    import runpy

    from plait.interpreter.backends.local import Runtime
    from plait.lang import set_default_backend

    runtime = Runtime(**engine_kwargs(args))
    set_default_backend(runtime)
    sys.argv = [args.file, *args.args]
    try:
        runpy.run_path(args.file, run_name="__main__")
    finally:
        runtime.shutdown()
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    """The model packages plait runs by name (installed or not), and the architectures it runs
    from any GGUF file or Hugging Face folder."""
    import json

    from plait.runtime.model_loader.packages import MODEL_PACKAGES
    from plait.runtime.models.registry import families

    packages = []
    for package in MODEL_PACKAGES:
        installed = package.installed()
        path = package.peek() if installed else None
        if path is not None:
            status = "ready"
        elif installed:
            status = "installed (its file is assembled on first use)"
        else:
            status = f"not installed: {package.install}"
        packages.append(
            {
                "name": package.name,
                "installed": installed,
                "path": path,
                "status": status,
                "description": package.description,
            }
        )
    archs = [
        {
            "family": f.name,
            "hf_architectures": list(f.hf_architectures),
            "gguf_architectures": list(f.gguf_architectures),
        }
        for f in families()
    ]
    if args.json:
        print(json.dumps({"packages": packages, "architectures": archs}, indent=2))
        return 0
    width = max(len(p["name"]) for p in packages)
    print("Model packages (--model NAME):")
    for p in packages:
        print(f"  {p['name']:<{width}}  {p['description']}")
        print(f"  {'':<{width}}  {p['status']}{': ' + p['path'] if p['path'] else ''}")
    print("\nAny .gguf file or Hugging Face folder (--model PATH) of these architectures:")
    width = max(len(a["family"]) for a in archs)
    for a in archs:
        print(
            f"  {a['family']:<{width}}  GGUF {', '.join(a['gguf_architectures'])}; "
            f"Hugging Face {', '.join(a['hf_architectures'])}"
        )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    code = _run_bench(args)
    if code == 0 and getattr(args, "plot", None):
        from plait.benchmarks.plots import plot_file

        plot_file(args.output, args.plot, args.workload)
    return code


def _run_bench(args: argparse.Namespace) -> int:
    if args.workload == "latency":
        from plait.benchmarks.latency import run_latency_bench

        return run_latency_bench(args)
    if args.workload == "serving":
        from plait.benchmarks.serving import run_serving_bench

        return run_serving_bench(args)
    if args.workload == "programs":
        from plait.benchmarks.programs import run_programs_bench

        return run_programs_bench(args)
    if args.workload == "speculative":
        from plait.benchmarks.speculative import run_speculative_bench

        return run_speculative_bench(args)
    if args.workload == "kv-tiers":
        from plait.benchmarks.kv_tiers import run_kv_tiers_bench

        return run_kv_tiers_bench(args)
    if args.workload == "json":
        from plait.benchmarks.json_bench import run_json_bench

        return run_json_bench(args)
    if args.workload == "healing":
        from plait.benchmarks.healing_bench import run_healing_bench

        return run_healing_bench(args)
    if args.workload == "jsonschema":
        from plait.benchmarks.jsonschema_bench import run_jsonschema_bench

        return run_jsonschema_bench(args)
    if args.workload == "pd":
        from plait.benchmarks.prefill_decode import run_prefill_decode_bench

        return run_prefill_decode_bench(args)
    if args.workload == "data-parallel":
        from plait.benchmarks.data_parallel import run_data_parallel_bench

        return run_data_parallel_bench(args)
    if args.workload == "throughput":
        from plait.benchmarks.throughput import run_throughput_bench

        return run_throughput_bench(args)
    if args.workload == "kernels":
        from plait.benchmarks.kernels import run_kernels_bench

        return run_kernels_bench(args)
    if args.workload == "overhead":
        from plait.benchmarks.overhead import run_overhead_bench

        return run_overhead_bench(args)
    if args.workload == "dashboard":
        from plait.benchmarks.dashboard import run_dashboard_bench

        return run_dashboard_bench(args)
    if args.workload == "llama-cpp":
        from plait.benchmarks.llama_cpp import run_llama_cpp_bench

        return run_llama_cpp_bench(args)
    raise SystemExit(f"plait bench: unknown workload {args.workload!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="plait", description="plait: programs over language models")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for a prompt, streamed to the terminal")
    gen.add_argument("prompt", help="the text to continue (a user message with --chat)")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    gen.add_argument(
        "--max-tokens", dest="max_tokens", type=int, default=128, help="tokens to generate at most"
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: the engine's)")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    run = sub.add_parser("run", help="run a Python file of plait programs on the default model")
    run.add_argument("file", help="the Python file to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the file")
    add_engine_args(run)
    run.set_defaults(func=_cmd_run)

    models = sub.add_parser(
        "models", help="the models plait runs here: model packages by name, architectures"
    )
    models.add_argument("--json", action="store_true", help="print JSON instead of a list")
    models.set_defaults(func=_cmd_models)

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
    from plait.server.cli import add_serve_parser

    add_serve_parser(sub)
    from plait.server.top import add_top_parser

    add_top_parser(sub)
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
