"""`plait bench json`: structured extraction with an 8-field JSON schema on the default model.

End-to-end time with jump-forward on and off at several request counts, cold (prompts prefilled)
and warm (prompts in the prefix cache: decoding alone), beside unconstrained generation of the same
lengths; the per-token mask cost (fill + apply) and the schema compile time; and, per JSON spacing
(`json_whitespace`), extraction accuracy and jump-forward's speedup (`json_spacing.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from plait.benchmarks.common import print_table, write_json
from plait.benchmarks.json_spacing import PEOPLE, SPACING_HEADERS, accuracy, spacing_rows

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "city": {"type": "string", "maxLength": 30},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "city", "role", "active", "score", "tags"],
    "additionalProperties": False,
}

_NAMES = [
    "Ada Park",
    "Bo Chen",
    "Cleo Diaz",
    "Dev Rao",
    "Eli Stone",
    "Fay Lin",
    "Gus Moore",
    "Hana Ito",
]
_CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Pune", "Quito", "Riga"]


def prompts(tokenizer: Any, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name, city = rng.choice(_NAMES), rng.choice(_CITIES)
        bio = (
            f"{name} is {rng.randint(19, 80)} years old, lives in {city} and can be reached at "
            f"{name.split()[0].lower()}{i}@example.org. "
            f"An {rng.choice(['admin', 'user', 'guest'])} "
            f"account, currently {'active' if rng.random() < 0.5 else 'inactive'}, score "
            f"{rng.randint(0, 100)}. Interests: "
            f"{', '.join(rng.sample(['chess', 'jazz', 'hiking', 'go', 'tea'], 2))}."
        )
        out.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Extract the person as JSON.\n\n{bio}"}]
            )
        )
    return out


def timed_batch(engine: Any, texts: list[str], params: list[dict]) -> tuple[float, list[dict]]:
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(texts, params)
    return time.perf_counter() - start, outs


def step_costs(
    engine: Any, texts: list[str], schema: str, batch: int, max_new_tokens: int
) -> dict[str, float]:
    """Mean decode-step time of `batch` constrained requests (jump-forward off, so every step is a
    plain decode step) against unconstrained requests of exactly the same output lengths."""
    texts = texts[:batch]

    def per_step(params: list[dict]) -> tuple[float, list[dict]]:
        steps = engine.stats()["total_steps"]
        seconds, outs = timed_batch(engine, texts, params)
        return seconds / (engine.stats()["total_steps"] - steps), outs

    constrained, outs = per_step(
        [{"max_new_tokens": max_new_tokens, "temperature": 0, "json_schema": schema}] * len(texts)
    )
    lengths = [o["meta_info"]["completion_tokens"] for o in outs]
    free, _ = per_step(
        [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lengths]
    )
    return {
        "constrained_step_ms": 1e3 * constrained,
        "unconstrained_step_ms": 1e3 * free,
        "constrained_step_overhead": constrained / free - 1,
    }


def mask_costs(engine: Any, outs: list[dict], batch: int) -> dict[str, float]:
    """Replays the generated tokens through fresh grammars, timing fill and apply per step."""
    from plait.kernels.constraint_mask import allocate_token_bitmask, apply_token_bitmask
    from plait.runtime.constrained import make_grammar_key

    cache = engine._grammar_cache()
    compiled = cache.get(make_grammar_key(json_schema=SCHEMA))
    fills: list[float] = []
    for out in outs:
        grammar = compiled.new_grammar()
        mask = allocate_token_bitmask(1, engine.args.vocab_size)
        for token in out["output_ids"]:
            start = time.perf_counter()
            grammar.fill_bitmask(mask, 0)
            fills.append(time.perf_counter() - start)
            if not grammar.try_advance(token):
                break
    logits = torch.randn(batch, engine.args.vocab_size)
    bitmask = allocate_token_bitmask(batch, engine.args.vocab_size)
    applies = []
    for _ in range(50):
        start = time.perf_counter()
        apply_token_bitmask(logits, bitmask, list(range(batch)))
        applies.append(time.perf_counter() - start)
    fills.sort()
    return {
        "fill_us_mean": 1e6 * statistics.mean(fills),
        "fill_us_p99": 1e6 * fills[int(0.99 * (len(fills) - 1))],
        f"apply_us_mean_batch{batch}": 1e6 * statistics.mean(applies),
    }


def compile_seconds(engine: Any) -> float:
    from plait.runtime.constrained import GrammarCache, create_grammar_backend, make_grammar_key

    backend = create_grammar_backend("auto", engine.tokenizer, vocab_size=engine.args.vocab_size)
    backend.compile(make_grammar_key(regex="[0-9]+"))  # vocabulary build, once per tokenizer
    cache = GrammarCache(backend)
    start = time.perf_counter()
    cache.get(make_grammar_key(json_schema=SCHEMA))
    elapsed = time.perf_counter() - start
    cache.shutdown()
    return elapsed


def _summary(seconds: float, outs: list[dict]) -> dict[str, Any]:
    valid = 0
    for o in outs:
        try:
            json.loads(o["text"])
            valid += 1
        except ValueError:
            pass
    return {
        "seconds": seconds,
        "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        "jump_forward_tokens": sum(o["meta_info"].get("jump_forward_tokens", 0) for o in outs),
        "valid_json": valid,
        "sample": outs[0]["text"],
    }


def spacing_names(value: str) -> list[str]:
    from plait.runtime.protocol import JSON_WHITESPACE

    names = [v.strip() for v in str(value).split(",") if v.strip()]
    bad = [n for n in names if n not in JSON_WHITESPACE]
    if not names or bad:
        raise SystemExit(
            f"--spacings: {value!r}: expected a comma-separated list of "
            f"{', '.join(JSON_WHITESPACE)}"
        )
    return names


def request_counts(value: str) -> list[int]:
    counts = [int(v) for v in str(value).split(",") if v.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit(
            f"--num-requests: {value!r} is not a comma-separated list of positive counts"
        )
    return counts


def run_json_bench(args: argparse.Namespace) -> int:
    """Per request count, jump-forward on and off in one engine each: a cold run (empty prefix
    cache: every prompt prefilled) and a warm one (the same prompts again, their KV cached, so the
    run is the decoding alone). The largest count also runs unconstrained generation of the same
    lengths and the per-step mask costs."""
    from plait.runtime.config_flags import engine_kwargs
    from plait.runtime.engine import Engine

    kwargs = engine_kwargs(args)
    counts = request_counts(args.num_requests)
    largest = max(counts)
    results: dict[str, Any] = {"by_requests": {}}
    schema = json.dumps(SCHEMA)
    base = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    runs: dict[str, tuple[float, list[dict]]] = {}
    spacings = spacing_names(args.spacings)
    by_spacing: dict[str, dict[str, Any]] = {s: {} for s in spacings}
    for jf in (True, False):
        name = f"jump-forward {'on' if jf else 'off'}"
        engine = Engine(**{**kwargs, "disable_jump_forward": not jf})
        try:
            engine.generate(
                prompts(engine.tokenizer, 1)[0], {**base, "json_schema": schema}
            )  # warm up + compile
            for spacing in spacings:  # the largest count, cold, under each spacing
                params = [{**base, "json_schema": schema, "json_whitespace": spacing}] * largest
                engine.generate(prompts(engine.tokenizer, 1)[0], params[0])  # its compile
                seconds, outs = timed_batch(engine, prompts(engine.tokenizer, largest), params)
                summary = _summary(seconds, outs)
                entry = by_spacing[spacing]
                entry[f"jf_{'on' if jf else 'off'}_s"] = seconds
                if jf:
                    entry.update(
                        output_tokens=summary["output_tokens"],
                        jumped=summary["jump_forward_tokens"],
                        valid_json=summary["valid_json"],
                        accuracy=accuracy(engine, spacing),
                    )
            for n in counts:
                texts = prompts(engine.tokenizer, n)
                params = [{**base, "json_schema": schema}] * n
                cold = timed_batch(engine, texts, params)
                start = time.perf_counter()
                warm_outs = engine.generate(texts, params)
                warm = _summary(time.perf_counter() - start, warm_outs)
                entry = results["by_requests"].setdefault(str(n), {})
                entry[name] = {"cold": _summary(*cold), "warm": warm}
                if n == largest:
                    runs[name] = cold
            if not jf:
                results["steps"] = step_costs(
                    engine,
                    prompts(engine.tokenizer, largest),
                    schema,
                    args.mask_batch,
                    args.max_new_tokens,
                )
            else:
                texts = prompts(engine.tokenizer, largest)
                lengths = [o["meta_info"]["completion_tokens"] for o in runs[name][1]]
                runs["unconstrained"] = timed_batch(
                    engine,
                    texts,
                    [{**base, "max_new_tokens": n, "ignore_eos": True} for n in lengths],
                )
                results["mask"] = mask_costs(engine, runs[name][1], args.mask_batch)
                results["compile_s"] = compile_seconds(engine)
        finally:
            engine.shutdown()
    rows = []
    for n in counts:
        entry = results["by_requests"][str(n)]
        on, off = entry["jump-forward on"], entry["jump-forward off"]
        for phase in ("cold", "warm"):
            entry[f"speedup_{phase}"] = off[phase]["seconds"] / on[phase]["seconds"]
        rows.append(
            [
                n,
                off["cold"]["seconds"],
                on["cold"]["seconds"],
                entry["speedup_cold"],
                off["warm"]["seconds"],
                on["warm"]["seconds"],
                entry["speedup_warm"],
                f"{on['cold']['jump_forward_tokens']}/{on['cold']['output_tokens']}",
                f"{on['cold']['valid_json']}+{off['cold']['valid_json']}/{2 * n}",
            ]
        )
    print(
        "\nExtraction requests under an 8-field schema, greedy, in one batch; cold: prompts "
        "prefilled, warm: prompts in the prefix cache"
    )
    print_table(
        [
            "requests",
            "off s",
            "on s",
            "JF speedup",
            "off s (warm)",
            "on s (warm)",
            "JF speedup (warm)",
            "jumped/output",
            "valid JSON",
        ],
        rows,
    )
    off_s = runs["jump-forward off"][0]
    rows = []
    for name, (seconds, outs) in runs.items():
        results[name] = _summary(seconds, outs)
        r = results[name]
        rows.append(
            [
                name,
                seconds,
                r["output_tokens"] / seconds,
                off_s / seconds,
                r["jump_forward_tokens"],
                f"{r['valid_json']}/{len(outs)}",
            ]
        )
    print(f"\n{largest} requests, cold, beside unconstrained generation of the same lengths")
    print_table(
        ["run", "seconds", "output tok/s", "speedup vs JF off", "jumped tokens", "valid JSON"], rows
    )
    m = results["mask"]
    print(
        f"\nmask fill per token: {m['fill_us_mean']:.1f} us mean, {m['fill_us_p99']:.1f} us P99; "
        f"apply for {args.mask_batch} rows: {m[f'apply_us_mean_batch{args.mask_batch}']:.1f} us; "
        f"schema compile {results['compile_s']:.2f} s"
    )
    st = results["steps"]
    print(
        f"decode step at batch {args.mask_batch} (jump-forward off): "
        f"constrained {st['constrained_step_ms']:.1f} ms, "
        f"unconstrained {st['unconstrained_step_ms']:.1f} ms "
        f"({st['constrained_step_overhead']:+.1%})"
    )
    print(f"sample: {results['jump-forward on']['sample']}")
    results["spacing"] = by_spacing
    print(
        f"\nJSON spacing (json_whitespace): {len(PEOPLE)} name/age/city extractions, greedy, "
        f"checked against the paragraphs; {largest} 8-field requests, cold, jump-forward off and on"
    )
    print_table(SPACING_HEADERS, spacing_rows(by_spacing))
    write_json(args.output, {"benchmark": "json", "results": results})
    return 0
