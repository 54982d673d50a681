"""`plait bench speculative`: decode speed with each drafter vs none, batch 1 and 8, on an
extractive workload (quote or rewrite text from the prompt) and on open-ended chat. All engines
are loaded at once and take turns batch by batch (`--rounds` passes over the prompts, pooled), so
that a drift of the machine's speed between minutes does not read as a speed-up or a slow-down."""

from __future__ import annotations

import argparse
import time
from typing import Any

from plait.benchmarks.common import print_table, write_json

PASSAGES = [
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
    "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 "
    "to 1889 as the centerpiece of the 1889 World's Fair.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return "
    "total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n    return "
    "sum((v - m) ** 2 for v in values) / len(values)\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. It generally involves the green pigment "
    "chlorophyll and generates oxygen as a byproduct.",
    "The mitochondrion is an organelle found in the cells of most eukaryotes. Mitochondria use "
    "aerobic respiration to generate adenosine triphosphate, which is used throughout the cell as "
    "a source of chemical energy.",
]
EXTRACTIVE = [
    "Repeat the following passage exactly, word for word:\n\n{p}",
    "Rewrite this text exactly, but change the first word to uppercase:\n\n{p}",
]
CHAT = [
    "Write a short poem about the sea.",
    "Give me three tips for a job interview.",
    "Explain why the sky is blue to a child.",
    "What should I cook tonight? Suggest something.",
    "Describe a walk in a forest in autumn.",
    "How do I learn a new language quickly?",
    "Tell me a story about a brave cat.",
    "What are the benefits of reading books?",
]


def workload(tokenizer: Any, kind: str, n: int) -> list[str]:
    if kind == "extractive":
        items = [t.format(p=p) for t in EXTRACTIVE for p in PASSAGES]
    else:
        items = list(CHAT)
    items = (items * (n // len(items) + 1))[:n]
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in items]


def run_group(engine: Any, group: list[str], max_new_tokens: int) -> dict:
    """One batch of prompts decoded together: tokens, seconds and speculation counts."""
    engine.generate(group, {"max_new_tokens": 0})  # prefill outside the timed decode
    before = engine.stats()
    start = time.perf_counter()
    outs = engine.generate(group, {"max_new_tokens": max_new_tokens, "temperature": 0})
    seconds = time.perf_counter() - start
    after = engine.stats()
    counts = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTS}
    return {
        "tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        "seconds": seconds,
        **counts,
    }


SPEC_COUNTS = ("spec_verify_steps", "spec_proposed_tokens", "spec_accepted_tokens")


def summarize(runs: list[dict]) -> dict:
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    steps, proposed, accepted = (sum(r[k] for r in runs) for k in SPEC_COUNTS)
    return {
        "decode_tok_s": tokens / seconds,
        "mean_accept_length": (accepted + steps) / steps if steps else None,
        "acceptance_rate": accepted / proposed if proposed else None,
    }


def run_speculative_bench(args: argparse.Namespace) -> int:
    from plait.runtime.config_flags import engine_kwargs
    from plait.runtime.engine import Engine

    kwargs = engine_kwargs(args)
    algos: list[str | None] = [None, *[a for a in args.algorithms.split(",") if a]]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rounds = max(1, getattr(args, "rounds", 2))
    engines: dict[str, Any] = {}
    rows, results = [], []
    try:
        for algo in algos:
            if algo == "draft_model" and not args.draft_model_path:
                print("skipping draft_model: pass --draft-model-path")
                continue
            engines[algo or "none"] = Engine(**{**kwargs, "speculative_algorithm": algo})
        names = list(engines)
        tokenizer = engines[names[0]].tokenizer
        for kind in ("extractive", "chat"):
            for b in batches:
                prompts = workload(tokenizer, kind, max(b, args.num_prompts))
                groups = [prompts[i : i + b] for i in range(0, len(prompts), b)]
                runs: dict[str, list[dict]] = {name: [] for name in names}
                for name in names:
                    engines[name].generate(prompts[0], {"max_new_tokens": 4})  # warm up
                # NOTE: a shared machine's speed can drift by tens of percent between minutes, so
                # the engines take turns batch by batch, in alternating order, and their runs are
                # pooled.
                for r in range(rounds):
                    for g, group in enumerate(groups):
                        for name in names if (r + g) % 2 == 0 else names[::-1]:
                            runs[name].append(run_group(engines[name], group, args.max_new_tokens))
                for name in names:
                    results.append(
                        {"algorithm": name, "workload": kind, "batch": b, **summarize(runs[name])}
                    )
    finally:
        for engine in engines.values():
            engine.shutdown()
    base = {
        (r["workload"], r["batch"]): r["decode_tok_s"] for r in results if r["algorithm"] == "none"
    }
    for r in results:
        speedup = r["decode_tok_s"] / base[(r["workload"], r["batch"])]
        r["speedup"] = speedup
        rows.append(
            [
                r["algorithm"],
                r["workload"],
                r["batch"],
                r["decode_tok_s"],
                speedup,
                r["mean_accept_length"],
                r["acceptance_rate"],
            ]
        )
    print(
        f"\ngreedy, {args.max_new_tokens} new tokens, "
        f"num_draft_tokens {kwargs.get('num_draft_tokens')}, "
        f"{rounds} alternating rounds"
    )
    print_table(
        ["drafter", "workload", "batch", "decode tok/s", "speedup", "accept len", "accept rate"],
        rows,
    )
    write_json(args.output, {"benchmark": "speculative", "rounds": rounds, "results": results})
    return 0
