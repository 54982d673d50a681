"""`plait bench speculative`: decode speed with each drafter vs none, batch 1 and 8, on an
extractive workload (quote or rewrite text from the prompt) and on open-ended chat."""

from __future__ import annotations

import argparse
import time
from typing import Any

from plait.benchmarks.common import print_table, write_json

PASSAGES = [
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
    "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 "
    "to 1889 as the centerpiece of the 1889 World's Fair.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / "
    "len(values)\n\n\ndef variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v "
    "in values) / len(values)\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. It generally involves the green pigment "
    "chlorophyll and generates oxygen as a byproduct.",
    "The mitochondrion is an organelle found in the cells of most eukaryotes. Mitochondria use "
    "aerobic respiration to generate adenosine triphosphate, which is used throughout the cell as a "
    "source of chemical energy.",
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


def run_once(engine: Any, prompts: list[str], max_new_tokens: int, batch: int) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    engine.generate(prompts[0], {"max_new_tokens": 4})
    before = engine.stats()
    produced, seconds = 0, 0.0
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        engine.generate(group, {"max_new_tokens": 0})  # prefill outside the timed decode
        start = time.perf_counter()
        outs = engine.generate(group, params)
        seconds += time.perf_counter() - start
        produced += sum(o["meta_info"]["completion_tokens"] for o in outs)
    after = engine.stats()
    steps, proposed, accepted = (
        after.get(k, 0) - before.get(k, 0)
        for k in ("spec_verify_steps", "spec_proposed_tokens", "spec_accepted_tokens")
    )
    return {
        "decode_tok_s": produced / seconds,
        "mean_accept_length": (accepted + steps) / steps if steps else None,
        "acceptance_rate": accepted / proposed if proposed else None,
    }


def run_speculative_bench(args: argparse.Namespace) -> int:
    from plait.cli import engine_kwargs
    from plait.runtime.engine import Engine

    kwargs = engine_kwargs(args)
    algos: list[str | None] = [None, *[a for a in args.algorithms.split(",") if a]]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows, results = [], []
    for algo in algos:
        extra: dict[str, Any] = {"speculative_algorithm": algo}
        if algo == "draft_model":
            if not args.draft_model_path:
                print("skipping draft_model: pass --draft-model-path")
                continue
        engine = Engine(**{**kwargs, **extra})
        try:
            for kind in ("extractive", "chat"):
                for b in batches:
                    prompts = workload(engine.tokenizer, kind, max(b, args.num_prompts))
                    r = run_once(engine, prompts, args.max_new_tokens, b)
                    results.append({"algorithm": algo or "none", "workload": kind, "batch": b, **r})
        finally:
            engine.shutdown()
    base = {(r["workload"], r["batch"]): r["decode_tok_s"] for r in results if r["algorithm"] == "none"}
    for r in results:
        speedup = r["decode_tok_s"] / base[(r["workload"], r["batch"])]
        r["speedup"] = speedup
        rows.append([r["algorithm"], r["workload"], r["batch"], r["decode_tok_s"], speedup,
                     r["mean_accept_length"], r["acceptance_rate"]])
    print(f"\ngreedy, {args.max_new_tokens} new tokens, num_draft_tokens {kwargs.get('num_draft_tokens')}")
    print_table(["drafter", "workload", "batch", "decode tok/s", "speedup", "accept len", "accept rate"], rows)
    write_json(args.output, {"benchmark": "speculative", "results": results})
    return 0
