"""`plait bench programs`: whole programs on the default model, with the radix cache on and off,
against the same program logic written directly on `transformers` (sequential, no cache).

Workloads reuse the programs in `examples/`:
1. fewshot: `fewshot_select.classify`, a 5-shot prefix shared by every review, `select` a label.
2. tot: `tree_of_thought.tree_of_thought` with width 3: plans, checks of each plan (depth 2),
   then a `select` of the best plan and a short answer.
3. agent: `react_agent.agent`: up to 3 turns of `select` an action, `gen(regex=...)` its
   argument, run the Python tool (calculator or dictionary lookup), append the observation.

The transformers versions (`programs_transformers.py`) build the same ChatML text (the default
model's template) and call `model.generate` (greedy or sampled, stopping at the same strings) and
one forward per `select` choice, scored like plait's default `token_length_normalized`.
`gen(regex=...)` is approximated by a greedy `gen` cut to its longest prefix that matches the
regex (a fixed fallback when none does); the texts the baselines build are checked against
plait's in tests/integration/test_bench_programs.py. Each system runs one program of each workload
untimed first (grammar compilation, first-call costs); plait then starts from an empty cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from plait.benchmarks.common import print_table, write_json
from plait.benchmarks.programs_transformers import (
    Outcome,
    TransformersLM,
    agent_baseline,
    fewshot_baseline,
    load_transformers_lm,
    tot_baseline,
)

WORKLOADS = ("fewshot", "tot", "agent")
DEFAULT_ITEMS = {"fewshot": 64, "tot": 8, "agent": 16}
TARGETS = {"vs_cache_off": {"fewshot": 3.0}, "vs_transformers": 5.0}
ON, OFF, HF = "plait cache on", "plait cache off", "transformers"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

SUBJECTS = ["The plot", "The cast", "The soundtrack", "The ending"]
GOOD = "brilliant delightful moving gorgeous hilarious gripping charming superb".split()
BAD = "boring clumsy tedious ugly painful lifeless confusing awful".split()
REVIEWS = [
    (f"{subject} was {adj}, {verdict}", label)
    for subject in SUBJECTS
    for good, bad in zip(GOOD, BAD)
    for adj, verdict, label in (
        (good, "and I would watch it again.", "positive"),
        (bad, "and I want my money back.", "negative"),
    )
]
PROBLEMS = [
    "A farmer has 3 fields with 12 cows each. He sells 10 cows. How many are left?",
    "Tom has 5 boxes of 8 pencils. He gives away 9 pencils. How many does he keep?",
    "A train goes 60 km an hour for 3 hours, then 40 km more. How far does it go?",
    "A shop sells 4 apples for 2 dollars. How much do 20 apples cost?",
    "Anna reads 15 pages a day. How many days does a 120-page book take her?",
    "A class has 28 students. Half play football and 5 of those swim. How many only play football?",
    "A baker makes 7 trays of 16 cookies and burns 12. How many good cookies are left?",
    "Sam saves 25 dollars a week. How many weeks until he has 300 dollars?",
]
SUMS = [
    "17 times 23",
    "144 divided by 12",
    "305 plus 718",
    "1000 minus 377",
    "45 times 19",
    "9 times 81",
    "2048 divided by 16",
    "123 plus 456",
    "88 times 12",
    "500 minus 123",
]
WORDS = ["plait", "cache", "token", "prefix", "kernel", "tensor"]
TASKS = [f"What is {q}?" for q in SUMS] + [f"What does the word {w} mean?" for w in WORDS]
EXTRA_WORDS = {  # added to the example's dictionary, so most lookups find something
    "token": "a piece of text a language model reads or writes",
    "prefix": "a part added to the start of something",
    "kernel": "the central or most important part of something",
    "tensor": "an array of numbers with any number of dimensions",
}


@dataclass(frozen=True)
class Workload:
    name: str
    program: Any  # a plait `Program`
    items: list[dict[str, Any]]
    value: Callable[[Any], Any]  # ProgramState -> Outcome.value
    baseline: Callable[[Any, dict[str, Any]], Outcome]  # (lm, item) -> Outcome
    truth: list[Any] | None = None


def load_example(name: str) -> ModuleType:
    path = EXAMPLES / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"bench programs: needs the example {path} (run from a checkout)")
    spec = importlib.util.spec_from_file_location(f"plait_bench_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cycle(items: list[Any], n: int) -> list[Any]:
    return (items * (n // len(items) + 1))[:n]


# workloads and runs ----------------------------------------------------------------------------


def build_workloads(names: list[str], num_items: dict[str, int], tot_width: int) -> list[Workload]:
    made: dict[str, Workload] = {}
    if "fewshot" in names:
        ex = load_example("fewshot_select")
        reviews = cycle(REVIEWS, num_items["fewshot"])
        made["fewshot"] = Workload(
            "fewshot",
            ex.classify,
            [{"review": r} for r, _ in reviews],
            lambda s: s["label"],
            fewshot_baseline(ex),
            [label for _, label in reviews],
        )
    if "tot" in names:
        ex = load_example("tree_of_thought")
        items = [{"question": q, "width": tot_width} for q in cycle(PROBLEMS, num_items["tot"])]
        made["tot"] = Workload(
            "tot", ex.tree_of_thought, items, lambda s: s["answer"], tot_baseline
        )
    if "agent" in names:
        ex = load_example("react_agent")
        ex.DICTIONARY.update(EXTRA_WORDS)
        items = [{"question": q} for q in cycle(TASKS, num_items["agent"])]
        made["agent"] = Workload("agent", ex.agent, items, tool_calls, agent_baseline(ex))
    return [made[n] for n in names]


def tool_calls(state: Any) -> int:
    """Observations after the agent's own question (the worked examples have some too)."""
    users = [m["content"] for m in state.messages() if m["role"] == "user"]
    question = max(i for i, c in enumerate(users) if c.startswith("Question:"))
    return sum(c.startswith("Observation:") for c in users[question:])


def quality(workload: Workload, values: list[Any]) -> dict[str, float]:
    if workload.truth is not None:
        return {"accuracy": sum(v == t for v, t in zip(values, workload.truth)) / len(values)}
    if workload.name == "agent":
        return {"mean_tool_calls": sum(values) / len(values)}
    return {}


def run_plait(runtime: Any, workload: Workload, num_threads: int | str) -> dict[str, Any]:
    engine = runtime.engine
    workload.program.run(**workload.items[0], backend=runtime)  # warm-up: grammars, kernels
    while not engine.flush_cache():  # every workload starts from an empty cache
        time.sleep(0.05)
    before = engine.stats()
    start = time.perf_counter()
    states = workload.program.run_batch(workload.items, backend=runtime, num_threads=num_threads)
    seconds = time.perf_counter() - start
    after = engine.stats()
    prompt = after["total_prompt_tokens"] - before["total_prompt_tokens"]
    cached = (
        after["cache_hit_rate"] * after["total_prompt_tokens"]
        - before["cache_hit_rate"] * before["total_prompt_tokens"]
    )
    return {
        "seconds": seconds,
        "computed_tokens": after["total_computed_tokens"] - before["total_computed_tokens"],
        "prompt_tokens": prompt,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        **quality(workload, [workload.value(s) for s in states]),
    }


def run_transformers(lm: TransformersLM, workload: Workload) -> dict[str, Any]:
    import torch

    with torch.inference_mode():
        workload.baseline(lm, workload.items[0])  # warm-up, as for plait
        torch.manual_seed(0)
        prompt, computed = lm.prompt_tokens, lm.computed_tokens
        start = time.perf_counter()
        outcomes = [workload.baseline(lm, item) for item in workload.items]
    return {
        "seconds": time.perf_counter() - start,
        "computed_tokens": lm.computed_tokens - computed,
        "prompt_tokens": lm.prompt_tokens - prompt,
        "cache_hit_rate": 0.0,
        **quality(workload, [o.value for o in outcomes]),
    }


def add_programs_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated: fewshot,tot,agent"
    )
    parser.add_argument(
        "--num-items",
        dest="num_items",
        default="",
        help="programs per workload: N for all, or e.g. fewshot=8,tot=2 (defaults 64/8/16)",
    )
    parser.add_argument(
        "--tot-width", dest="tot_width", type=int, default=3, help="tree-of-thought fork width"
    )
    parser.add_argument(
        "--num-threads", dest="num_threads", default="auto", help="run_batch threads"
    )
    parser.add_argument(
        "--no-transformers",
        dest="transformers",
        action="store_false",
        help="skip the transformers baseline",
    )
    parser.add_argument(
        "--torch-threads",
        dest="torch_threads",
        type=int,
        default=None,
        help="torch.set_num_threads for every system (on a busy machine 1 avoids thread stalls; "
        "default: torch's own)",
    )
    parser.add_argument(
        "--output", default="bench-results/programs.json", help="JSON file of the results"
    )


def parse_num_items(spec: str) -> dict[str, int]:
    counts = dict(DEFAULT_ITEMS)
    for part in filter(None, spec.split(",")):
        name, _, n = part.rpartition("=")
        if (name and name not in WORKLOADS) or not n.isdigit() or int(n) < 1:
            raise SystemExit(
                f"--num-items: expected N or workload=N (workloads {WORKLOADS}), got {part!r}"
            )
        counts.update({name: int(n)} if name else dict.fromkeys(WORKLOADS, int(n)))
    return counts


def run_programs_bench(args: argparse.Namespace) -> int:
    from plait.interpreter.backends.local import Runtime
    from plait.runtime.config_flags import engine_kwargs
    from plait.runtime.engine import Engine

    names = [n for n in args.workloads.split(",") if n]
    if unknown := sorted(set(names) - set(WORKLOADS)):
        raise SystemExit(f"--workloads: unknown {unknown}; choose from {','.join(WORKLOADS)}")
    threads = args.num_threads if args.num_threads == "auto" else int(args.num_threads)
    workloads = build_workloads(names, parse_num_items(args.num_items), args.tot_width)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    kwargs = engine_kwargs(args)
    results: list[dict[str, Any]] = []
    dtype = None
    for system, disable in ((ON, False), (OFF, True)):
        engine = Engine(**{**kwargs, "disable_radix_cache": disable})
        dtype = engine.dtype
        try:
            runtime = Runtime(engine=engine)
            for w in workloads:
                results.append(
                    {
                        "workload": w.name,
                        "system": system,
                        "programs": len(w.items),
                        **run_plait(runtime, w, threads),
                    }
                )
                print(f"{w.name}: {system} {results[-1]['seconds']:.1f} s", flush=True)
        finally:
            engine.shutdown()
    if args.transformers:
        lm = load_transformers_lm(args.model_path, dtype)
        for w in workloads:
            results.append(
                {
                    "workload": w.name,
                    "system": HF,
                    "programs": len(w.items),
                    **run_transformers(lm, w),
                }
            )
            print(f"{w.name}: transformers {results[-1]['seconds']:.1f} s", flush=True)
    return report(args, results, names)


def report(args: argparse.Namespace, results: list[dict[str, Any]], names: list[str]) -> int:
    by = {(r["workload"], r["system"]): r for r in results}
    for r in results:
        r["programs_per_s"] = r["programs"] / r["seconds"]

    def ratio(name: str, key: str, top: str, bottom: str) -> float | None:
        a, b = by.get((name, top)), by.get((name, bottom))
        return a[key] / b[key] if a and b else None

    speedups = {
        n: {
            "vs_cache_off": ratio(n, "programs_per_s", ON, OFF),
            "vs_transformers": ratio(n, "programs_per_s", ON, HF),
            "fewer_tokens_vs_cache_off": ratio(n, "computed_tokens", OFF, ON),
            "fewer_tokens_vs_transformers": ratio(n, "computed_tokens", HF, ON),
        }
        for n in names
    }
    print(f"\nrun_batch threads: {args.num_threads}")
    print_table(
        [
            "workload",
            "system",
            "programs",
            "seconds",
            "programs/s",
            "computed tok",
            "prompt tok",
            "hit rate",
            "cache-on speed-up",
            "accuracy / tool calls",
        ],
        [
            [
                r["workload"],
                r["system"],
                r["programs"],
                r["seconds"],
                r["programs_per_s"],
                r["computed_tokens"],
                r["prompt_tokens"],
                r["cache_hit_rate"],
                ratio(r["workload"], "programs_per_s", ON, r["system"]),
                r.get("accuracy", r.get("mean_tool_calls")),
            ]
            for r in results
        ],
    )
    print("\nplait with the cache on: speed-up in programs/s, and x fewer tokens computed")
    print_table(
        [
            "workload",
            "x cache off",
            "target",
            "x transformers",
            "target",
            "x fewer tok vs off",
            "x fewer tok vs transformers",
        ],
        [
            [
                n,
                s["vs_cache_off"],
                TARGETS["vs_cache_off"].get(n),
                s["vs_transformers"],
                TARGETS["vs_transformers"],
                s["fewer_tokens_vs_cache_off"],
                s["fewer_tokens_vs_transformers"],
            ]
            for n, s in speedups.items()
        ],
    )
    write_json(
        args.output,
        {
            "benchmark": "programs",
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "results": results,
            "speedups": speedups,
            "targets": TARGETS,
        },
    )
    return 0
