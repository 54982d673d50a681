"""The `plait` command line: `plait generate`, `plait bench`. Only this module reads argv."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """A flag's help ends with its default, unless the help says what it is itself (a default
    of None means something that only words say: "default: the model's")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "default" in help or action.default in (None, argparse.SUPPRESS):
            return help
        if action.default == "":
            return help + ' (default: "")'
        return super()._get_help_string(action) or ""


class Parser(argparse.ArgumentParser):
    """Every `plait` parser and subparser: help shows each flag's default, and a value that a
    configuration refuses (`config_checks`) is a usage error naming its flag, exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        # each builds a configuration from the parsed arguments, raising ValueError("field: ...")
        self.config_checks: list[Callable[[argparse.Namespace], object]] = []

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # NOTE: a subcommand's parser runs this too, on its own namespace, so its usage line is
        # the one printed.
        parsed, rest = super().parse_known_args(args, namespace)
        for check in self.config_checks:
            try:
                check(parsed)
            except (ValueError, TypeError) as e:
                self.error(self.flag_message(str(e)))
        return parsed, rest

    def error(self, message: str) -> NoReturn:
        """Exit 2 with a one-line usage (`--help` lists the flags) and the error."""
        positionals = [
            "{" + ",".join(a.choices) + "}" if a.choices else (a.metavar or a.dest)
            for a in self._actions
            if not a.option_strings
        ]
        usage = " ".join([f"usage: {self.prog} [options]", *map(str, positionals)])
        self.exit(2, f"{usage}\n{self.prog}: error: {message}\n")

    def flag_message(self, message: str) -> str:
        """`"page_size: must be ..."` as `"argument --page-size/--block-size: must be ..."`."""
        field, sep, rest = message.partition(": ")
        for action in self._actions:
            if sep and action.dest == field and action.option_strings:
                return f"argument {'/'.join(action.option_strings)}: {rest}"
        return message


# SGLang's and vLLM's spellings of the same settings (other fields: the field's name only)
_ENGINE_FLAGS = {
    "model_path": ("--model", "--model-path"),
    "context_length": ("--context-length", "--max-model-len"),
    "page_size": ("--page-size", "--block-size"),
    "max_running_requests": ("--max-running-requests", "--max-num-seqs"),
    "num_draft_tokens": ("--num-draft-tokens", "--speculative-num-draft-tokens"),
    "draft_model_path": ("--draft-model-path", "--speculative-draft-model-path"),
    "tp_size": ("--tp-size", "--tp", "--tensor-parallel-size"),
}
# requests waiting beyond the running batch are the server's to admit or refuse: a `plait serve`
# flag (`--max-queued-requests`), not one of every command
_SERVER_FIELDS = ("max_queued_requests",)
_ENGINE_HELP = {
    "model_path": "a .gguf file, a Hugging Face folder (config.json, *.safetensors) or an "
    "installed model package's name (smollm2, gemma3-270m; `plait models`); default: smollm2, "
    "the embedded SmolLM2-135M-Instruct",
    "dtype": "weights and activations (auto: bfloat16 on GPUs, float32 on the CPU)",
    "device": "auto (a GPU when there is one), cpu, cuda or cuda:N",
    "context_length": "tokens of prompt and output per request (default: the model's)",
    "quantization": "float32: dequantize a GGUF's blocks; int8 / int4: weight-only quantization "
    "(default: a GGUF's blocks as stored where the CPU kernels read them, else the checkpoint's dtype)",
    "page_size": "KV cache tokens per page (1-1024)",
    "max_total_tokens": "KV pool size in tokens (default: from mem-fraction-static)",
    "mem_fraction_static": "share of free GPU memory (default 0.8) or of RAM (0.1) for the KV "
    "pool, in (0, 1)",
    "disable_radix_cache": "do not reuse cached prefixes between requests",
    "kv_cache_dtype": "KV cache storage (auto: the model's dtype; bfloat16 for int8/int4 weights "
    "on the CPU)",
    "schedule_policy": "order of waiting requests: lpm (longest cached prefix first), fcfs, "
    "dfs-weight",
    "max_running_requests": "requests decoded together in one batch (>= 1)",
    "max_prefill_tokens": "prompt tokens prefilled per step (>= 1)",
    "chunked_prefill_size": "longer prompts are prefilled in chunks of this many tokens (>= 1)",
    "num_continuous_decode_steps": "decode steps run back to back in one native call on the CPU "
    "while nothing waits; 1 turns it off",
    "random_seed": "seed of the engine's sampling where a request gives none",
    "check_invariants": "verify page accounting and the radix tree after every step (slow; tests)",
    "grammar_backend": "constrained decoding library",
    "grammar_compile_timeout": "seconds a request waits for its constraint to compile (then a 400)",
    "grammar_compile_memory_mb": "memory limit of the child process that compiles constraints; "
    "0 compiles in process",
    "disable_jump_forward": "sample every token, also the ones a constraint forces",
    "json_whitespace": "how JSON under a schema is spaced: conventional (one space after : and ,), "
    "compact (none) or flexible (the model's own)",
    "json_max_digit_run": "digits in a row under a JSON schema, where the schema allows more; 0: off",
    "json_max_whitespace_run": "whitespace characters in a row under a JSON schema; 0: off",
    "budget_closing": "close constrained outputs near max_new_tokens on a valid end",
    "speculative_algorithm": "speculative decoding drafter (default: none)",
    "speculation": "with a drafter: auto (measured per batch size), always, never",
    "num_draft_tokens": "tokens drafted per verification step (1-32)",
    "draft_model_path": "the draft model, required with --speculative-algorithm draft_model "
    "(default: none)",
    "draft_layers": "self drafting: the target's first N layers (default: a quarter)",
    "tp_size": "tensor parallelism: ranks (processes) the model is sharded over",
    "cpu_threads": "threads every step runs on (default: every core, small steps may run on one)",
}


def _engine_choices() -> dict[str, Sequence[str]]:
    from plait.runtime import config
    from plait.runtime.constrained import available_grammar_backends

    return {
        "dtype": config._DTYPES,
        "quantization": config._QUANTIZATIONS,
        "kv_cache_dtype": config._KV_CACHE_DTYPES,
        "schedule_policy": config._POLICIES,
        "grammar_backend": ("auto", *available_grammar_backends()),
        "speculative_algorithm": ("ngram", "self", "draft_model"),
        "speculation": ("auto", "always", "never"),
    }


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per engine configuration field, named like the `Engine(...)` keyword (and
    SGLang's and vLLM's spellings where theirs differ); their values are checked at parse time
    when `parser` is a `Parser`."""
    import dataclasses
    import typing

    from plait.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    choices = _engine_choices()
    group = parser.add_argument_group("engine")
    for klass in (ModelConfig, CacheConfig, SchedulerConfig, EngineConfig):
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if f.name in ("model", "cache", "scheduler", *_SERVER_FIELDS):
                continue
            flags = _ENGINE_FLAGS.get(f.name, ("--" + f.name.replace("_", "-"),))
            kind = hints[f.name]
            default = f.default
            help = _ENGINE_HELP.get(f.name)
            if kind is bool:  # a field that defaults on also gets its `--no-...` form
                action = argparse.BooleanOptionalAction if default is True else "store_true"
                group.add_argument(*flags, dest=f.name, action=action, default=default, help=help)
                continue
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            if f.name in choices:
                group.add_argument(*flags, dest=f.name, type=base, default=default, help=help,
                                   choices=choices[f.name])  # fmt: skip
            else:
                group.add_argument(*flags, dest=f.name, type=base, default=default, help=help,
                                   metavar=f.name.upper())  # fmt: skip
    if isinstance(parser, Parser):
        parser.config_checks.append(engine_config)


def engine_config(args: argparse.Namespace) -> Any:
    from plait.runtime.config import EngineConfig

    return EngineConfig.from_kwargs(**engine_kwargs(args))


def engine_kwargs(args: argparse.Namespace) -> dict:
    import dataclasses

    from plait.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    names = {
        f.name
        for klass in (ModelConfig, CacheConfig, SchedulerConfig, EngineConfig)
        for f in dataclasses.fields(klass)
        if f.name not in ("model", "cache", "scheduler")
    }
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


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
        packages.append({"name": package.name, "installed": installed, "path": path,
                         "status": status, "description": package.description})  # fmt: skip
    archs = [{"family": f.name, "hf_architectures": list(f.hf_architectures),
              "gguf_architectures": list(f.gguf_architectures)} for f in families()]  # fmt: skip
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
        print(f"  {a['family']:<{width}}  GGUF {', '.join(a['gguf_architectures'])}; "
              f"Hugging Face {', '.join(a['hf_architectures'])}")  # fmt: skip
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
    if args.workload == "json":
        from plait.benchmarks.json_bench import run_json_bench

        return run_json_bench(args)
    if args.workload == "healing":
        from plait.benchmarks.healing_bench import run_healing_bench

        return run_healing_bench(args)
    if args.workload == "jsonschema":
        from plait.benchmarks.jsonschema_bench import run_jsonschema_bench

        return run_jsonschema_bench(args)
    if args.workload == "data-parallel":
        from plait.benchmarks.data_parallel import run_data_parallel_bench

        return run_data_parallel_bench(args)
    if args.workload == "throughput":
        from plait.benchmarks.throughput import run_throughput_bench

        return run_throughput_bench(args)
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
        help="comma-separated: float32, bfloat16 (dtypes: blocks dequantized), native (blocks as stored), "
        "int8, int4 (weight-only quantization)",
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
        p.add_argument("--plot", metavar="DIR", default=None,
                       help="also write figures of the results into DIR (needs plait[bench]; default: none)")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
