"""Speculative decoding through the Engine: identical greedy output, exact stops, pages."""

from __future__ import annotations

import json
import re
import threading

import pytest

from plait import Engine
from plait.kernels import decode_stack
from plait.runtime.engine import SPECULATIVE_BURST_STEPS

PROMPTS = [
    "one two three four one two three four one two three",
    "abc abc abc abc abc abc",
    "The cat sat on the mat. The cat sat on the",
    "x",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def spec_engine(tiny_llama_dir):
    engine = Engine(
        model_path=str(tiny_llama_dir),
        max_total_tokens=4096,
        page_size=4,
        speculative_algorithm="ngram",
        num_draft_tokens=4,
        check_invariants=True,
        speculation="always",  # these tests check what drafts do, not whether they pay
    )
    yield engine
    engine.shutdown()


def test_greedy_identical_alone_and_batched(tiny_engine, spec_engine):
    expected = [tiny_engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    assert [spec_engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS] == expected
    assert [o["output_ids"] for o in spec_engine.generate(PROMPTS, GREEDY)] == expected
    stats = spec_engine.stats()
    assert stats["spec_verify_steps"] > 0 and stats["spec_proposed_tokens"] > 0


def test_stops_and_max_tokens_exact_with_several_tokens_per_step(tiny_engine, spec_engine):
    ref = tiny_engine.generate(PROMPTS[0], GREEDY)
    text = ref["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    for params in (
        {**GREEDY, "stop": [stop]},
        {**GREEDY, "max_new_tokens": 7},
        {**GREEDY, "stop_token_ids": [ref["output_ids"][5]]},
    ):
        a = tiny_engine.generate(PROMPTS[0], params)
        b = spec_engine.generate(PROMPTS[0], params)
        assert (b["output_ids"], b["text"], b["meta_info"]["finish_reason"]) == (
            a["output_ids"],
            a["text"],
            a["meta_info"]["finish_reason"],
        )


def test_constrained_requests_with_speculation(tiny_engine, spec_engine):
    params = {"temperature": 0.0, "max_new_tokens": 40, "regex": r"(ab|cd){2,6}"}
    a = tiny_engine.generate("ab cd ab cd ab", params)
    b = spec_engine.generate("ab cd ab cd ab", params)
    assert b["output_ids"] == a["output_ids"] and re.fullmatch(r"(ab|cd){2,6}", b["text"])
    schema = json.dumps(
        {"type": "object", "properties": {"k": {"enum": ["aa", "bb"]}}, "required": ["k"]}
    )
    b = spec_engine.generate(
        '{"k":"aa"} {"k":"aa"}', {"temperature": 0.0, "max_new_tokens": 20, "json_schema": schema}
    )
    assert json.loads(b["text"])["k"] in ("aa", "bb")


def test_sampling_with_speculation_and_concurrency_keeps_pages_exact(spec_engine):
    results = {}

    def call(i: int) -> None:
        results[i] = spec_engine.generate(
            PROMPTS[i % len(PROMPTS)], {"temperature": 0.8, "seed": i, "max_new_tokens": 30}
        )

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r["meta_info"]["completion_tokens"] >= 1 for r in results.values())
    s = spec_engine.stats()
    assert (
        s["kv_pages_in_use"] == 0
        and s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]
    )


def test_abort_while_speculating_frees_pages(spec_engine):
    stream = spec_engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 300}, stream=True)
    for i, _ in enumerate(stream):
        if i == 4:
            break
    stream.close()
    import time

    deadline = time.time() + 10
    while spec_engine.stats()["num_running"] and time.time() < deadline:
        time.sleep(0.01)
    assert spec_engine.stats()["kv_pages_in_use"] == 0


def test_unknown_algorithm_is_named(tiny_llama_dir):
    with pytest.raises(ValueError, match="speculative_algorithm"):
        Engine(model_path=str(tiny_llama_dir), speculative_algorithm="magic")


@pytest.mark.parametrize("algo", ["self", "draft_model"])
def test_model_drafters_keep_greedy_output(tiny_llama_dir, tiny_engine, algo):
    kwargs = {"draft_layers": 1} if algo == "self" else {"draft_model_path": str(tiny_llama_dir)}
    engine = Engine(
        model_path=str(tiny_llama_dir),
        max_total_tokens=4096,
        page_size=4,
        speculative_algorithm=algo,
        num_draft_tokens=3,
        check_invariants=True,
        **kwargs,
    )
    try:
        expected = [tiny_engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
        assert [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)] == expected
        stats = engine.stats()
        assert stats["spec_verify_steps"] > 0
        if algo == "draft_model":  # the draft is the target itself: every draft is accepted
            assert stats["spec_acceptance_rate"] > 0.95
        assert stats["kv_pages_in_use"] == 0
    finally:
        engine.shutdown()


@pytest.mark.skipif(not decode_stack.burst_available(), reason="native CPU kernels did not build")
def test_steps_without_drafts_run_as_bursts(tiny_engine, spec_engine, monkeypatch):
    bursts: list[int] = []
    real = spec_engine.core.runner.bursts.run

    def spy(batch, steps, interrupt=None):
        bursts.append(steps)
        return real(batch, steps, interrupt)

    monkeypatch.setattr(spec_engine.core.runner.bursts, "run", spy)
    params = {**GREEDY, "max_new_tokens": 40}
    expected = tiny_engine.generate("x", params)["output_ids"]
    # speculating, a step the drafter found nothing for runs as a short burst: it looks again soon
    before = spec_engine.stats()["total_burst_steps"]
    assert spec_engine.generate("x", params)["output_ids"] == expected
    assert bursts and all(2 <= steps <= SPECULATIVE_BURST_STEPS for steps in bursts)
    assert spec_engine.stats()["total_burst_steps"] > before
    # where drafts are not tried (`never`, or `auto` once they do not pay), decodes run as whole
    # bursts
    monkeypatch.setattr(spec_engine.core.speculation.policy, "mode", "never")
    bursts.clear()
    assert spec_engine.generate("x", params)["output_ids"] == expected
    assert max(bursts) > SPECULATIVE_BURST_STEPS


def test_speculation_never_keeps_the_drafter_but_verifies_nothing(tiny_llama_dir, tiny_engine):
    with Engine(
        model_path=str(tiny_llama_dir),
        max_total_tokens=2048,
        speculative_algorithm="ngram",
        speculation="never",
    ) as engine:
        assert engine.core.drafter is not None
        expected = tiny_engine.generate(PROMPTS[0], GREEDY)["output_ids"]
        assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == expected
        stats = engine.stats()
        assert stats["spec_mode"] == "never" and stats["spec_verify_steps"] == 0
