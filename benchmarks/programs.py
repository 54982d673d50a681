"""`plait bench programs`: whole programs on the default model, with the radix cache on and off,
against the same program logic written directly on `transformers` (sequential, no cache).

Workloads reuse the programs in `examples/`:
1. fewshot: `fewshot_select.classify`, a 5-shot prefix shared by every review, `select` a label.
2. tot: `tree_of_thought.tree_of_thought` with width 3: plans, checks of each plan (depth 2),
   then a `select` of the best plan and a short answer.
3. agent: `react_agent.agent`: up to 3 turns of `select` an action, `gen(regex=...)` its
   argument, run the Python tool (calculator or dictionary lookup), append the observation.

The transformers versions build the same ChatML text (the default model's template) and call
`model.generate` (greedy or sampled, stopping at the same strings) and one forward per `select`
choice, scored like plait's default `token_length_normalized`. `gen(regex=...)` is
approximated by a greedy `gen` cut to its longest prefix that matches the regex (a fixed
fallback when none does); the texts the baselines build are checked against plait's in
tests/integration/test_bench_programs.py. Each system runs one program of each workload
untimed first (grammar compilation, first-call costs); plait then starts from an empty cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from plait.benchmarks.common import print_table, write_json
from plait.thirdparty import import_transformers

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
    "17 times 23", "144 divided by 12", "305 plus 718", "1000 minus 377", "45 times 19",
    "9 times 81", "2048 divided by 16", "123 plus 456", "88 times 12", "500 minus 123",
]  # fmt: skip
WORDS = ["plait", "cache", "token", "prefix", "kernel", "tensor"]
TASKS = [f"What is {q}?" for q in SUMS] + [f"What does the word {w} mean?" for w in WORDS]
EXTRA_WORDS = {  # added to the example's dictionary, so most lookups find something
    "token": "a piece of text a language model reads or writes",
    "prefix": "a part added to the start of something",
    "kernel": "the central or most important part of something",
    "tensor": "an array of numbers with any number of dimensions",
}
ARGUMENT_FALLBACK = {"calculator": " 0", "lookup": " unknown"}


class Outcome(NamedTuple):
    text: str  # the whole text the program built
    value: Any  # the label (fewshot), the answer (tot), the number of tool calls (agent)


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


# the same programs on transformers -------------------------------------------------------------


def turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def open_turn(role: str) -> str:
    return f"<|im_start|>{role}\n"


END = "<|im_end|>\n"


def fewshot_baseline(example: ModuleType) -> Callable[[Any, dict[str, Any]], Outcome]:
    def run(lm: Any, item: dict[str, Any]) -> Outcome:
        text = turn("system", "Label each movie review as positive or negative.")
        text += "".join(turn("user", t) + turn("assistant", label) for t, label in example.SHOTS)
        text += turn("user", item["review"]) + open_turn("assistant")
        label = lm.select(text, ["positive", "negative"])
        return Outcome(text + label + END, label)

    return run


def tot_baseline(lm: Any, item: dict[str, Any]) -> Outcome:
    width = item["width"]
    head = turn("system", "You solve problems step by step.") + turn("user", item["question"])
    head += open_turn("assistant") + "Let me try different approaches.\n"
    plans = []
    for i in range(width):
        branch = head + f"Approach {i + 1}:"
        plan = lm.gen(branch, 16, stop="\n", temperature=0.7, min_tokens=3)
        for _ in range(width):
            lm.gen(branch + plan + "\nCheck:", 10, stop="\n", temperature=0.7, min_tokens=3)
        plans.append(plan)
    text = head + "".join(f"Approach {i + 1}: {p.strip()}\n" for i, p in enumerate(plans))
    text += "The best approach is"
    text += lm.select(text, [f" {i + 1}" for i in range(width)]) + ". Answer:"
    answer = lm.gen(text, 12, stop="\n")
    return Outcome(text + answer + END, answer)


def constrain(text: str, regex: str, fallback: str) -> str:
    """The longest prefix of `text` matching `regex` (the stand-in for constrained decoding)."""
    for end in range(len(text), 0, -1):
        if re.fullmatch(regex, text[:end]):
            return text[:end]
    return fallback


def agent_baseline(example: ModuleType) -> Callable[[Any, dict[str, Any]], Outcome]:
    def run(lm: Any, item: dict[str, Any], max_steps: int = 3) -> Outcome:
        text = turn("system", example.SYSTEM) + "".join(turn(r, c) for r, c in example.EXAMPLE)
        text += turn("user", f"Question: {item['question']}")
        calls = 0
        for step in range(max_steps):
            text += open_turn("assistant") + "Action:"
            action = lm.select(text, [" calculator", " lookup"] + ([" finish"] if step else []))
            text += action
            name = action.strip()
            if name == "finish":
                text += END
                break
            text += "\nInput:"
            raw = lm.gen(text, 12, stop="\n")
            argument = constrain(raw, example.ARGUMENT_REGEX[name], ARGUMENT_FALLBACK[name])
            text += argument + END
            text += turn("user", f"Observation: {example.TOOLS[name](argument)}")
            calls += 1
        text += open_turn("assistant") + "Answer:"
        return Outcome(text + lm.gen(text, 16, stop="\n") + END, calls)

    return run


class TransformersLM:
    """`gen` and `select` on a transformers model, one request at a time, no prefix cache."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.prompt_tokens = 0
        self.computed_tokens = 0  # prefill + decode steps actually run, as the engine counts

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def gen(
        self,
        text: str,
        max_tokens: int,
        stop: str = "\n",
        temperature: float = 0.0,
        min_tokens: int = 0,
    ) -> str:
        import torch

        ids = self.encode(text)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        out = self.model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens, min_new_tokens=min_tokens, stop_strings=[stop],
            tokenizer=self.tokenizer, eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.eos_token_id,
            **(sampling if temperature > 0 else {"do_sample": False}),
        )  # fmt: skip
        new = out[0, len(ids) :].tolist()
        self.prompt_tokens += len(ids)
        self.computed_tokens += len(ids) + max(len(new) - 1, 0)
        return self.tokenizer.decode(new, skip_special_tokens=True).split(stop)[0]

    def select(self, text: str, choices: list[str]) -> str:
        import torch

        prompt = self.encode(text)
        scores = []
        for choice in choices:
            full = self.encode(text + choice)
            k = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), len(prompt))
            k = max(1, min(k, len(full) - 1))  # choice tokens: full[k:], merged ones included
            # [len(full) - k + 1, vocab]: logits for the last prompt token and the choice's
            logits = self.model(torch.tensor([full]), logits_to_keep=len(full) - k + 1).logits[0]
            logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
            picked = logprobs.gather(1, torch.tensor(full[k:]).unsqueeze(1))
            scores.append(picked.mean().item())
            self.prompt_tokens += len(full)
            self.computed_tokens += len(full)
        return choices[max(range(len(choices)), key=lambda i: (scores[i], -i))]


def load_transformers_lm(model_path: str | None, dtype: Any) -> TransformersLM:
    import os

    transformers = import_transformers()

    from plait.benchmarks.throughput import load_transformers
    from plait.runtime.model_loader.locate import locate_checkpoint

    transformers.logging.set_verbosity_error()
    loc = locate_checkpoint(model_path)
    if loc.kind == "gguf":
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(loc.path), gguf_file=os.path.basename(loc.path)
        )
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(loc.path)
    return TransformersLM(load_transformers(model_path, dtype), tokenizer)


# workloads and runs ----------------------------------------------------------------------------


def build_workloads(names: list[str], num_items: dict[str, int], tot_width: int) -> list[Workload]:
    made: dict[str, Workload] = {}
    if "fewshot" in names:
        ex = load_example("fewshot_select")
        reviews = cycle(REVIEWS, num_items["fewshot"])
        made["fewshot"] = Workload(
            "fewshot", ex.classify, [{"review": r} for r, _ in reviews],
            lambda s: s["label"], fewshot_baseline(ex), [label for _, label in reviews],
        )  # fmt: skip
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
        help="torch.set_num_threads for every system (on a busy machine 1 avoids thread stalls)",
    )
    parser.add_argument("--output", default="bench-results/programs.json")  # fmt: skip


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
    from plait.cli import engine_kwargs
    from plait.interpreter.backends.local import Runtime
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
                results.append({"workload": w.name, "system": system, "programs": len(w.items),
                                **run_plait(runtime, w, threads)})  # fmt: skip
                print(f"{w.name}: {system} {results[-1]['seconds']:.1f} s", flush=True)
        finally:
            engine.shutdown()
    if args.transformers:
        lm = load_transformers_lm(args.model_path, dtype)
        for w in workloads:
            results.append({"workload": w.name, "system": HF, "programs": len(w.items),
                            **run_transformers(lm, w)})  # fmt: skip
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
        ["workload", "system", "programs", "seconds", "programs/s", "computed tok", "prompt tok",
         "hit rate", "cache-on speed-up", "accuracy / tool calls"],
        [[r["workload"], r["system"], r["programs"], r["seconds"], r["programs_per_s"],
          r["computed_tokens"], r["prompt_tokens"], r["cache_hit_rate"],
          ratio(r["workload"], "programs_per_s", ON, r["system"]),
          r.get("accuracy", r.get("mean_tool_calls"))] for r in results],
    )  # fmt: skip
    print("\nplait with the cache on: speed-up in programs/s, and x fewer tokens computed")
    print_table(
        ["workload", "x cache off", "target", "x transformers", "target", "x fewer tok vs off",
         "x fewer tok vs transformers"],
        [[n, s["vs_cache_off"], TARGETS["vs_cache_off"].get(n), s["vs_transformers"],
          TARGETS["vs_transformers"], s["fewer_tokens_vs_cache_off"],
          s["fewer_tokens_vs_transformers"]] for n, s in speedups.items()],
    )  # fmt: skip
    write_json(args.output, {
        "benchmark": "programs",
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "results": results, "speedups": speedups, "targets": TARGETS,
    })  # fmt: skip
    return 0
