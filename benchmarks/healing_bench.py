"""`plait bench healing`: few-shot accuracy with token healing on and off, on the default model.

Three-shot "Q: What is the capital of X?\\nA: Y" prompts for 27 more countries, greedy, scored by
whether the answer starts with the capital. The prompt ends either after "A:" or after "A: " (a
trailing space, where the model would have written " Paris" as one token); healing backs the
prompt up over that space so the model can.
"""

from __future__ import annotations

import argparse
from typing import Any

from plait.benchmarks.common import cpu_model, print_table, write_json

CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Germany", "Berlin"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Russia", "Moscow"),
    ("China", "Beijing"),
    ("Greece", "Athens"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
    ("Cuba", "Havana"),
    ("Chile", "Santiago"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Ireland", "Dublin"),
    ("Portugal", "Lisbon"),
    ("Sweden", "Stockholm"),
    ("Turkey", "Ankara"),
    ("India", "New Delhi"),
    ("Brazil", "Brasilia"),
    ("Mexico", "Mexico City"),
    ("Thailand", "Bangkok"),
    ("Iran", "Tehran"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Hungary", "Budapest"),
    ("Iraq", "Baghdad"),
]
SHOTS = 3


def accuracy(engine: Any, ending: str, healing: bool) -> tuple[int, int, list[str]]:
    shots, tests = CAPITALS[:SHOTS], CAPITALS[SHOTS:]
    head = "".join(f"Q: What is the capital of {c}?\nA: {a}\n" for c, a in shots)
    prompts = [head + f"Q: What is the capital of {c}?\nA:{ending}" for c, _ in tests]
    params = {"max_new_tokens": 8, "temperature": 0, "stop": ["\n"], "token_healing": healing}
    outs = engine.generate(prompts, params)
    right = sum(o["text"].strip().startswith(a) for o, (_, a) in zip(outs, tests))
    return right, len(tests), [o["text"] for o in outs[:4]]


def run_healing_bench(args: argparse.Namespace) -> int:
    from plait.runtime.config_flags import engine_kwargs
    from plait.runtime.engine import Engine

    engine = Engine(**engine_kwargs(args))
    rows, report = [], {"cpu": cpu_model(), "runs": []}
    try:
        for ending, name in (("", '"A:"'), (" ", '"A: " (trailing space)')):
            for healing in (False, True):
                right, total, examples = accuracy(engine, ending, healing)
                rows.append(
                    [name, "on" if healing else "off", f"{right}/{total}", " | ".join(examples)]
                )
                report["runs"].append(
                    {
                        "prompt_end": ending,
                        "healing": healing,
                        "correct": right,
                        "total": total,
                        "examples": examples,
                    }
                )
    finally:
        engine.shutdown()
    print_table(["prompt ends with", "healing", "correct", "first answers"], rows)
    write_json(args.output, report)
    return 0
