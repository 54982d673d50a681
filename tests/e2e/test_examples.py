"""Every example in examples/ runs on the default model (one shared engine), plus the language
checks that need a real model: a clear-cut `select`, JSON results, cached fork prefixes."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import plait
from plait import gen, program, select

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def example(name: str) -> dict:
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"), run_name=f"example_{name}")


@pytest.fixture(scope="module")
def runtime(default_engine):
    return plait.Runtime(engine=default_engine)


def test_select_with_a_clear_gap_picks_the_right_choice(runtime):
    @program
    def capital(s):
        s += "Q: What is the capital of France?\nA: The capital of France is"
        s += select("city", [" Tokyo", " Paris", " a banana"])

    state = capital.run(backend=runtime)
    assert state["city"] == " Paris"
    scores = state.get_meta_info("city")["scores"]
    assert scores[1] > max(scores[0], scores[2]) + 1.0


def test_fewshot_select(runtime):
    labels = example("fewshot_select")["main"](runtime)
    assert labels == ["positive", "negative", "positive", "negative"]


def test_json_extraction(runtime):
    mod = example("json_extraction")
    people = mod["main"](runtime)
    assert len(people) == 2 and all(isinstance(p, mod["Person"]) for p in people)


def test_tree_of_thought_branches_share_a_cached_prefix(runtime):
    state = example("tree_of_thought")["main"](runtime)
    assert len(state["plan"]) == 2 and [len(c) for c in state["check"]] == [2, 2]
    assert state["best"] in (" 1", " 2") and state["answer"]
    plan_metas = state.get_meta_info("plan")
    # the fork pre-fills the shared prefix, so every branch finds it in the radix cache
    assert all(m["cached_tokens"] >= 0.8 * m["prompt_tokens"] for m in plan_metas)


def test_react_agent_calls_real_tools(runtime):
    mod = example("react_agent")
    states = mod["main"](runtime)
    for state in states:
        actions = [m["content"] for m in state.messages() if m["content"].startswith("Action:")]
        assert actions and actions[0].split("\n")[0] in ("Action: calculator", "Action: lookup")
        assert any(m["content"].startswith("Observation: ") for m in state.messages())
        assert state["answer"].strip()
    assert mod["calculator"]("17 * 23") == "391"
    for state in states:
        assert re.fullmatch(r" [0-9a-z+\-*/. ()]+", state["input"])


def test_multi_turn_chat_reuses_earlier_turns(runtime):
    state = example("multi_turn_chat")["main"](runtime)
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system"] + ["user", "assistant"] * 3
    assert all(state[f"reply{i}"].strip() for i in range(3))
    later = [state.get_meta_info(f"reply{i}") for i in (1, 2)]
    assert all(m["cached_tokens"] > 0.5 * m["prompt_tokens"] for m in later)


def test_an_example_runs_as_a_script():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fewshot_select.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("positive") >= 2


def test_gen_defaults_from_run(runtime):
    @program
    def short(s):
        s += "Count: 1, 2, 3," + gen("more")

    state = short.run(backend=runtime, max_tokens=4, temperature=0)
    assert state.get_meta_info("more")["completion_tokens"] <= 4
