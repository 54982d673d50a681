"""The `plait` command line: `plait generate`, `plait bench`. Only this module reads argv."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from plait.bench_cli import add_bench_parser
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

    add_bench_parser(sub)
    from plait.server.cli import add_serve_parser
    from plait.server.top import add_top_parser

    add_serve_parser(sub)
    add_top_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
