"""The engine configuration's command-line flags: one per field of `EngineConfig` and its parts
(with SGLang's and vLLM's spellings where theirs differ), the parser every `plait` command uses
(help with defaults, a value a configuration refuses as a usage error naming its flag), and the
`Engine(...)` keywords the parsed flags give. `plait/cli.py`, `plait/bench_cli.py` and
`server/cli.py` build their commands on it; the server's never reads the facade's.
"""

from __future__ import annotations

import argparse
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
    "deterministic": ("--deterministic", "--enable-deterministic-inference"),
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
    "(default: a GGUF's blocks as stored where the CPU kernels read them, else the checkpoint's "
    "dtype)",
    "page_size": "KV cache tokens per page (1-1024)",
    "max_total_tokens": "KV pool size in tokens (default: from mem-fraction-static)",
    "mem_fraction_static": "share of free GPU memory (default 0.8) or of RAM (0.1) for the KV "
    "pool, in (0, 1)",
    "disable_radix_cache": "do not reuse cached prefixes between requests",
    "kv_cache_dtype": "KV cache storage (auto: the model's dtype; bfloat16 for int8/int4 weights "
    "on the CPU)",
    "kv_disk": "a directory where KV blocks are stored and found again, also by later runs "
    "(default: none)",
    "kv_disk_size": "the most the KV blocks in --kv-disk take, in bytes or with a unit (20G, 512M)",
    "kv_redis": "a Redis server that engines share KV blocks through, redis://host:port/db "
    "(default: none)",
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
    "json_max_digit_run": "digits in a row under a JSON schema, where the schema allows more; "
    "0: off",
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
    "deterministic": "batch-invariant inference: a request's tokens and logprobs do not depend on "
    "the requests batched with it (every step on the native CPU stack; slower prefill)",
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
                group.add_argument(
                    *flags,
                    dest=f.name,
                    type=base,
                    default=default,
                    help=help,
                    choices=choices[f.name],
                )
            else:
                group.add_argument(
                    *flags,
                    dest=f.name,
                    type=base,
                    default=default,
                    help=help,
                    metavar=f.name.upper(),
                )
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
