"""`plait bench jsonschema`: schema coverage and compliance on a sample of JSONSchemaBench.

The data is not shipped: point `--data` at the `data/` folder of a checkout of
guidance-ai/jsonschemabench (ten category folders of schema files). The sample is reproducible:
the files of each category sorted by name, `random.Random(seed).sample` of `--per-category`.

For each grammar backend: declared coverage (the schema compiles), compile time p50/p99 (after
one warm-up compile that builds the backend's per-tokenizer state, reported apart as
`first_compile_ms`), mask time per token (mean/p99, over a short random walk of each compiled
grammar); then for each `--max-tokens` budget, greedy generation on the default model of one
instance per covered schema, each output sorted into valid, finished-but-invalid, truncated
(length, not closed), closed early and valid, closed early but invalid. Last, constrained against
unconstrained decode tok/s at batch 1 and 16 (the same number of tokens each). With `--llama-cpp`,
llama.cpp's server on the same sample and budgets (`jsonschema_llama_cpp.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from plait.benchmarks.common import cpu_model, print_table, write_json

MAX_PROMPT_SCHEMA_CHARS = 6000  # longer schemas are not repeated in the prompt


def sample_schemas(data: Path, per_category: int, seed: int) -> list[tuple[str, str, Any]]:
    """(category, file name, schema) for the sample; unreadable files are skipped."""
    rng = random.Random(seed)
    out = []
    for category in sorted(p for p in data.iterdir() if p.is_dir()):
        files = sorted(category.glob("*.json"))
        for path in rng.sample(files, min(per_category, len(files))):
            try:
                schema = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            out.append((category.name, path.name, schema))
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def warm_up(engine: Any) -> float:
    """Seconds of the backend's first compile (a one-token regex), which builds its per-tokenizer
    state once; timed apart, so that the schemas' compile times are each schema's own."""
    from plait.runtime.constrained import make_grammar_key

    start = time.perf_counter()
    engine._grammar_cache().get(make_grammar_key(regex="[0-9]"))
    return time.perf_counter() - start


def compile_all(engine: Any, schemas: list[tuple[str, str, Any]], timeout: float) -> list[Any]:
    """The compiled grammar of each schema, or the error string; with compile seconds."""
    from plait.runtime.constrained import GrammarError, make_grammar_key

    cache = engine._grammar_cache()
    results = []
    for _, _, schema in schemas:
        start = time.perf_counter()
        try:
            key = make_grammar_key(
                json_schema=schema, json_whitespace=engine.config.json_whitespace
            )
            compiled: Any = cache.get(key, timeout=timeout)
        except (GrammarError, TimeoutError) as e:
            compiled = f"{type(e).__name__}: {e}"[:200]
        except Exception as e:  # a backend crash counts against coverage, not the run
            compiled = f"crash {type(e).__name__}: {e}"[:200]
        results.append((compiled, time.perf_counter() - start))
    return results


def mask_times(engine: Any, compiled: Any, steps: int = 24) -> list[float]:
    import numpy as np

    from plait.kernels.constraint_mask import allocate_token_bitmask

    rng = np.random.default_rng(0)
    grammar = compiled.new_grammar()
    bitmask = allocate_token_bitmask(1, engine.args.vocab_size)
    eos = engine.tokenizer.eos_token_ids
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        grammar.fill_bitmask(bitmask, 0)
        times.append(time.perf_counter() - start)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
        allowed = [t for t in np.flatnonzero(bits).tolist() if t not in eos]
        if not allowed or not grammar.try_advance(int(rng.choice(allowed))):
            break
    return times


def user_message(schema: Any) -> str:
    text = json.dumps(schema)
    ask = "Generate a JSON object that is a valid instance of this JSON schema."
    return f"{ask}\n\n{text}" if len(text) <= MAX_PROMPT_SCHEMA_CHARS else ask


def prompt_for(tokenizer: Any, schema: Any) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message(schema)}], add_generation_prompt=True
    )


def classify(out: dict, schema: Any) -> str:
    import jsonschema

    meta = out["meta_info"]
    finished = meta["finish_reason"]["type"] == "stop"
    closed = bool(meta.get("closed_early"))
    try:
        value = json.loads(out["text"])
        cls = jsonschema.validators.validator_for(schema)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    except Exception:  # the validator itself cannot read the schema (remote $ref, ...)
        return "unvalidated"
    if closed:
        return "closed_valid" if valid else "closed_invalid"
    if valid:
        return "valid"
    return "finished_invalid" if finished else "truncated"


def _generate_one(engine: Any, prompt: str, params: dict) -> dict:
    """One request; a refusal (the budget below the schema's shortest instance, as the server's
    400 says) becomes an empty output marked `refused`."""
    from plait.runtime.constrained import GrammarError

    try:
        return engine.generate(prompt, params)
    except GrammarError as e:
        return {
            "text": "",
            "meta_info": {
                "refused": str(e),
                "completion_tokens": 0,
                "finish_reason": {"type": "abort", "message": str(e)},
            },
        }


def generate_all(
    engine: Any, items: list[tuple[Any, Any]], max_tokens: int
) -> tuple[list[str], float, int]:
    prompts = [prompt_for(engine.tokenizer, schema) for schema, _ in items]
    params = [
        {"max_new_tokens": max_tokens, "temperature": 0, "json_schema": json.dumps(schema)}
        for schema, _ in items
    ]
    from plait.runtime.constrained import GrammarError

    start = time.perf_counter()
    try:
        outs = engine.generate(prompts, params)
    except GrammarError:  # a schema's shortest instance is longer than the budget: each alone
        outs = [_generate_one(engine, prompt, p) for prompt, p in zip(prompts, params)]
    seconds = time.perf_counter() - start
    kinds = [
        "budget_refused" if o["meta_info"].get("refused") else classify(o, schema)
        for o, (schema, _) in zip(outs, items)
    ]
    for out, kind in zip(outs, kinds):  # each schema's outcome, for the JSON report
        out["kind"] = kind
    return kinds, seconds, sum(o["meta_info"]["completion_tokens"] for o in outs), outs


# Schemas whose instances are long, for constrained against free decode speed.
# NOTE: minItems small enough for the outlines automaton (it unrolls the repetition)
SPEED_SCHEMAS = {
    # length-bounded strings: llguidance's slower masks (~190 us a row, against ~25 us unbounded)
    "strings": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 8},
    # records: forced keys (jump-forward), free strings and numbers
    "records": {
        "type": "array",
        "minItems": 4,
        "items": {
            "type": "object",
            "required": ["name", "color", "price"],
            "properties": {
                "name": {"type": "string"},
                "color": {"type": "string"},
                "price": {"type": "number"},
            },
        },
    },
}


def decode_speed(
    engine: Any, batch: int, tokens: int, schema: Any = SPEED_SCHEMAS["strings"]
) -> dict[str, float]:
    """Output tok/s of `batch` requests of up to `tokens` tokens each, free and under `schema`;
    each counts the tokens it wrote."""
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List many fruits, with their color and price."}],
        add_generation_prompt=True,
    )
    out = {}
    for name, extra in (
        ("free", {"ignore_eos": True}),
        ("constrained", {"json_schema": json.dumps(schema), "budget_closing": False}),
    ):
        params = {"max_new_tokens": tokens, "temperature": 0, **extra}
        engine.generate([prompt] * batch, [params] * batch)  # warm up, compile
        start = time.perf_counter()
        outs = engine.generate([prompt] * batch, [params] * batch)
        n = sum(o["meta_info"]["completion_tokens"] for o in outs)
        out[name] = n / (time.perf_counter() - start)
    return out


def run_jsonschema_bench(args: argparse.Namespace) -> int:
    from plait.runtime.config_flags import engine_kwargs
    from plait.runtime.constrained import GrammarError
    from plait.runtime.engine import Engine

    data = Path(args.data)
    if not data.is_dir():
        raise SystemExit(f"--data: {data} is not a folder (the data/ folder of jsonschemabench)")
    schemas = sample_schemas(data, args.per_category, args.seed)
    budgets = [int(b) for b in args.max_tokens.split(",")]
    report: dict[str, Any] = {
        "benchmark": "jsonschema",
        "cpu": cpu_model(),
        "seed": args.seed,
        "per_category": args.per_category,
        "num_schemas": len(schemas),
        "backends": {},
    }
    coverage_rows, outcome_rows, speed_rows = [], [], []
    for backend in args.backends.split(","):
        engine = Engine(
            **{
                **engine_kwargs(args),
                "grammar_backend": backend,
                "grammar_compile_timeout": args.compile_timeout,
            }
        )
        try:
            first_compile = warm_up(engine)
            compiled = compile_all(engine, schemas, args.compile_timeout)
            ok = [(s, c) for (_, _, s), (c, _) in zip(schemas, compiled) if not isinstance(c, str)]
            seconds = [t for c, t in compiled if not isinstance(c, str)]
            masks = [m for _, c in ok for m in mask_times(engine, c)]
            entry: dict[str, Any] = {
                "coverage": len(ok) / len(schemas),
                "compile_p50_ms": 1e3 * percentile(seconds, 0.5),
                "compile_p99_ms": 1e3 * percentile(seconds, 0.99),
                "compile_max_ms": 1e3 * max(seconds, default=float("nan")),
                "first_compile_ms": 1e3 * first_compile,
                "mask_mean_us": 1e6 * statistics.fmean(masks) if masks else float("nan"),
                "mask_p99_us": 1e6 * percentile(masks, 0.99),
                "refused": [
                    f"{cat}/{name}: {c}"
                    for (cat, name, _), (c, _) in zip(schemas, compiled)
                    if isinstance(c, str)
                ],
                "by_budget": {},
            }
            coverage_rows.append(
                [
                    backend,
                    f"{len(ok)}/{len(schemas)}",
                    entry["compile_p50_ms"],
                    entry["compile_p99_ms"],
                    entry["mask_mean_us"],
                    entry["mask_p99_us"],
                ]
            )
            for budget in budgets:
                kinds, secs, tokens, outs = generate_all(engine, ok, budget)
                counts = {
                    k: kinds.count(k)
                    for k in (
                        "valid",
                        "closed_valid",
                        "finished_invalid",
                        "truncated",
                        "closed_invalid",
                        "unvalidated",
                        "budget_refused",
                    )
                }
                counts["valid_share_of_all"] = (counts["valid"] + counts["closed_valid"]) / len(
                    schemas
                )
                counts["tok_per_s"] = tokens / secs
                entry["by_budget"][budget] = counts
                names = [
                    f"{cat}/{name}"
                    for (cat, name, _), (c, _) in zip(schemas, compiled)
                    if not isinstance(c, str)
                ]
                entry.setdefault("outcomes", {})[budget] = [
                    {
                        "schema": n,
                        "kind": o["kind"],
                        "completion_tokens": o["meta_info"]["completion_tokens"],
                        "text": o["text"][-200:],
                    }
                    for n, o in zip(names, outs)
                ]
                outcome_rows.append(
                    [
                        backend,
                        budget,
                        f"{counts['valid'] + counts['closed_valid']}/{len(schemas)}",
                        counts["closed_valid"],
                        counts["finished_invalid"],
                        counts["truncated"],
                        counts["closed_invalid"],
                        counts["unvalidated"],
                        counts["tok_per_s"],
                    ]
                )
            if not args.no_speed:
                for schema_name, schema in SPEED_SCHEMAS.items():
                    for batch in (1, 16):
                        key = (
                            f"decode_b{batch}"
                            if schema_name == "strings"
                            else f"decode_{schema_name}_b{batch}"
                        )
                        try:
                            speed = decode_speed(engine, batch, args.speed_tokens, schema)
                        except GrammarError as e:
                            entry[key] = f"{type(e).__name__}: {e}"[:200]
                            continue
                        entry[key] = speed
                        speed_rows.append(
                            [
                                backend,
                                schema_name,
                                batch,
                                speed["free"],
                                speed["constrained"],
                                speed["constrained"] / speed["free"],
                            ]
                        )
            report["backends"][backend] = entry
        finally:
            engine.shutdown()
    if args.llama_cpp:
        write_json(args.output, report)  # plait's part is kept should the baseline's run fail
        lc = llama_cpp_sample(args, schemas, budgets)
        report["llama.cpp"] = lc
        coverage_rows.append(
            [
                "llama.cpp",
                f"{round(lc['coverage'] * len(schemas))}/{len(schemas)}",
                None,
                None,
                None,
                None,
            ]
        )
        for budget, c in lc["by_budget"].items():
            outcome_rows.append(
                [
                    "llama.cpp",
                    budget,
                    f"{c['valid']}/{len(schemas)}",
                    None,
                    c["finished_invalid"],
                    c["truncated"],
                    None,
                    c["unvalidated"],
                    c["tok_per_s"],
                ]
            )
    print(
        f"JSONSchemaBench sample: {len(schemas)} schemas ({args.per_category} per category, "
        f"seed {args.seed}); {cpu_model()}"
    )
    print_table(
        ["backend", "covered", "compile p50 ms", "compile p99 ms", "mask mean us", "mask p99 us"],
        coverage_rows,
    )
    print_table(
        [
            "backend",
            "max_tokens",
            "valid (of all)",
            "closed early",
            "finished invalid",
            "truncated",
            "closed invalid",
            "unvalidated",
            "out tok/s",
        ],
        outcome_rows,
    )
    if speed_rows:
        print_table(
            ["backend", "schema", "batch", "free tok/s", "constrained tok/s", "ratio"], speed_rows
        )
    write_json(args.output, report)
    return 0


def llama_cpp_sample(
    args: argparse.Namespace, schemas: list[tuple[str, str, Any]], budgets: list[int]
) -> dict:
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"bench jsonschema --llama-cpp: needs llama-cpp-python[server] (`make bench-deps`): {e}"
        ) from e
    import torch

    from plait.benchmarks.jsonschema_llama_cpp import run_llama_cpp_sample
    from plait.runtime.model_loader.locate import locate_checkpoint

    loc = locate_checkpoint(args.model_path)
    if loc.kind != "gguf":
        raise SystemExit(
            "bench jsonschema --llama-cpp: llama.cpp needs a GGUF file (--model path/to/file.gguf)"
        )
    items = [(f"{cat}/{name}", schema, user_message(schema)) for cat, name, schema in schemas]
    return run_llama_cpp_sample(
        loc.path, torch.get_num_threads(), items, budgets, args.llama_cpp_timeout
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        required=True,
        help="the data/ folder of a jsonschemabench checkout (required, no default)",
    )
    parser.add_argument(
        "--per-category",
        dest="per_category",
        type=int,
        default=10,
        help="schemas drawn from each category",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw")
    parser.add_argument(
        "--max-tokens",
        dest="max_tokens",
        default="256,512",
        help="comma-separated token budgets; one run each",
    )
    parser.add_argument(
        "--backends", default="llguidance,outlines", help="comma-separated grammar backends"
    )
    parser.add_argument(
        "--compile-timeout",
        dest="compile_timeout",
        type=float,
        default=10.0,
        help="seconds a schema may take to compile",
    )
    parser.add_argument(
        "--speed-tokens",
        dest="speed_tokens",
        type=int,
        default=128,
        help="tokens per request of the decode-speed runs",
    )
    parser.add_argument(
        "--no-speed", dest="no_speed", action="store_true", help="skip the decode-speed runs"
    )
    parser.add_argument(
        "--llama-cpp",
        dest="llama_cpp",
        action="store_true",
        help="also llama.cpp's server on the sample (llama-cpp-python[server]: `make bench-deps`)",
    )
    parser.add_argument(
        "--llama-cpp-timeout",
        dest="llama_cpp_timeout",
        type=float,
        default=120.0,
        help="seconds per llama.cpp request before it counts as failed",
    )
    parser.add_argument(
        "--output", default="bench-results/jsonschema.json", help="JSON file of the results"
    )
