"""`plait bench programs`: a small run on the tiny model, and the transformers baselines build the
same text as the plait programs they stand beside."""

from __future__ import annotations

import argparse
import json

import pytest

from plait.benchmarks.programs import (
    WORKLOADS,
    add_programs_args,
    build_workloads,
    parse_num_items,
    run_programs_bench,
)
from plait.benchmarks.programs_transformers import constrain
from plait.runtime.config_flags import add_engine_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_programs_args(parser)
    add_engine_args(parser)
    return parser.parse_args(argv)


class ScriptedLM:
    """The baselines' `gen` / `select` answered like `MockBackend` answers plait."""

    def __init__(self, reply: str) -> None:
        self.reply = reply

    def gen(self, text, max_tokens, stop="\n", temperature=0.0, min_tokens=0):
        return self.reply

    def select(self, text, choices):
        from plait.interpreter.backends.mock import default_scorer, mock_tokenize

        def score(choice):
            tokens = mock_tokenize(choice)
            return sum(default_scorer(text, t) for t in tokens) / len(tokens)

        return max(choices, key=lambda c: (score(c), -choices.index(c)))


@pytest.mark.parametrize("name", WORKLOADS)
def test_baseline_builds_the_programs_text(name):
    import plait

    (workload,) = build_workloads([name], parse_num_items("1"), tot_width=3)
    item = workload.items[0]
    state = workload.program.run(**item, backend=plait.MockBackend(" cache"), temperature=0)
    outcome = workload.baseline(ScriptedLM(" cache"), item)
    assert outcome.text == state.text()
    assert outcome.value == workload.value(state)


def test_constrain_keeps_the_longest_matching_prefix():
    assert constrain(" 12 * 3 =", r" [0-9][0-9+\-*/. ()]{0,18}", " 0") == " 12 * 3 "
    assert constrain("nope", r" [a-z]{1,12}", " unknown") == " unknown"


def test_num_items_spec():
    assert parse_num_items("fewshot=4,agent=2") == {"fewshot": 4, "tot": 8, "agent": 2}
    assert parse_num_items("3") == dict.fromkeys(WORKLOADS, 3)
    with pytest.raises(SystemExit, match="--num-items"):
        parse_num_items("chat=2")


@pytest.fixture
def restore_torch_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_programs_smoke(tiny_llama_dir, tmp_path, capsys, restore_torch_threads):
    out = tmp_path / "programs.json"
    items = "fewshot=4,tot=2,agent=2"
    args = parse(
        [
            "--model",
            str(tiny_llama_dir),
            "--num-items",
            items,
            "--no-transformers",
            "--torch-threads",
            "1",
            "--max-total-tokens",
            "8192",
            "--output",
            str(out),
        ]
    )
    assert run_programs_bench(args) == 0
    assert "x cache off" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["benchmark"] == "programs"
    machine = data["machine"]  # what every benchmark's JSON says of where it ran
    assert machine["cpu"] and machine["native_isa"] in ("avx512-vnni", "avx2", "portable", "none")
    assert isinstance(machine["bf16_prefill_gemm"], bool)
    systems = [(r["workload"], r["system"]) for r in data["results"]]
    assert systems == [(w, s) for s in ("plait cache on", "plait cache off") for w in WORKLOADS]
    for r in data["results"]:
        assert r["programs"] == {"fewshot": 4, "tot": 2, "agent": 2}[r["workload"]]
        assert r["seconds"] > 0 and r["programs_per_s"] > 0
        assert r["computed_tokens"] > 0 and r["prompt_tokens"] > 0
        if r["system"] == "plait cache off":
            assert r["cache_hit_rate"] == 0
    on = {r["workload"]: r for r in data["results"] if r["system"] == "plait cache on"}
    off = {r["workload"]: r for r in data["results"] if r["system"] == "plait cache off"}
    assert on["fewshot"]["cache_hit_rate"] > 0.5  # the 5-shot prefix is computed once
    assert on["fewshot"]["computed_tokens"] < off["fewshot"]["computed_tokens"]
    assert 0 <= on["fewshot"]["accuracy"] <= 1 and 0 <= on["agent"]["mean_tool_calls"] <= 3
    assert set(data["speedups"]) == set(WORKLOADS)
    assert all(
        s["vs_transformers"] is None and s["vs_cache_off"] > 0 for s in data["speedups"].values()
    )
