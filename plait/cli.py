"""The `plait` command line: `plait generate`, `plait bench`. Only this module reads argv."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", dest="model_path", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--page-size", dest="page_size", type=int, default=1)
    parser.add_argument("--max-total-tokens", dest="max_total_tokens", type=int, default=None)


def _cmd_generate(args: argparse.Namespace) -> int:
    from plait.runtime.engine import Engine

    engine = Engine(
        model_path=args.model_path, dtype=args.dtype, device=args.device,
        page_size=args.page_size, max_total_tokens=args.max_total_tokens,
    )
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


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.workload == "latency":
        from plait.benchmarks.latency import run_latency_bench

        return run_latency_bench(args)
    raise SystemExit(f"plait bench: unknown workload {args.workload!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait", description="plait: programs over language models")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for a prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", dest="max_tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    _engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bench.add_argument("workload", choices=["latency"])
    bench.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes to measure")
    bench.add_argument("--prompt-len", dest="prompt_len", type=int, default=512)
    bench.add_argument("--decode-len", dest="decode_len", type=int, default=128)
    bench.add_argument("--no-transformers", dest="transformers", action="store_false", help="skip the transformers baseline")
    bench.add_argument("--output", default="bench-results/latency.json")
    bench.add_argument("--repeats", type=int, default=3)
    _engine_args(bench)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
