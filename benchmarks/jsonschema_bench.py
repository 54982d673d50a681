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
unconstrained decode tok/s at batch 1 and 16 (the same number of tokens each): plait's runs are in
`jsonschema_plait.py`. With `--llama-cpp`, llama.cpp's server on the same sample and budgets
(`jsonschema_llama_cpp.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from plait.benchmarks.common import cpu_model, print_table, write_json
from plait.benchmarks.jsonschema_plait import (
    SPEED_SCHEMAS,
    compile_all,
    decode_speed,
    generate_all,
    mask_times,
    user_message,
    warm_up,
)


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
