"""Constrained decodes in bursts: rows with a grammar run several native decode steps per call,
masked between steps (`runtime/constrained/burst_masks.py`), and give exactly the tokens, text
and finish reasons of one step at a time (greedy, and sampled with a seed), beside unconstrained
rows in the same burst; a burst ends where the grammar forces text (jump-forward takes it) and
before the point where budget-aware closing looks, as single steps would."""

from __future__ import annotations

import json

import pytest

from plait import Engine
from plait.kernels import decode_stack
from plait.runtime.decode_burst import BurstRunner
from tests.conftest import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    not decode_stack.burst_available(), reason="native CPU kernels did not build"
)

SCHEMA = {
    "type": "object",
    "properties": {
        "identifier": {"type": "integer"},
        "description": {"type": "string", "maxLength": 40},
    },
    "required": ["identifier", "description"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory, smollm_tokenizer):
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("cburst"), "llama", smollm_tokenizer, seed=3
    )
    common = dict(
        model_path=str(path), max_total_tokens=8192, check_invariants=True, quantization="int4"
    )
    with Engine(num_continuous_decode_steps=1, **common) as single, Engine(**common) as burst:
        yield single, burst


@pytest.fixture
def bursts(monkeypatch):
    """(rows constrained, tokens per row) of each burst run."""
    seen: list[tuple[list[bool], list[int]]] = []
    real = BurstRunner.run

    def record(self, batch, steps, *args, **kwargs):
        results = real(self, batch, steps, *args, **kwargs)
        seen.append(
            (
                [r.constraint.grammar is not None for r in batch.decodes],
                [len(r.tokens) for r in results],
            )
        )
        return results

    monkeypatch.setattr(BurstRunner, "run", record)
    return seen


def _run(engine: Engine, prompts, params) -> list[tuple]:
    outs = engine.generate(prompts, sampling_params=params)
    return [
        (
            o["output_ids"],
            o["text"],
            o["meta_info"]["finish_reason"],
            o["meta_info"].get("closed_early"),
        )
        for o in outs
    ]


def _pool_is_whole(engine: Engine) -> bool:
    stats = engine.stats()
    return stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]


def _constrained_bursts(seen) -> list[int]:
    return [n for rows, lens in seen for constrained, n in zip(rows, lens) if constrained]


def test_regex_rows_burst_and_give_the_tokens_of_single_steps(engines, bursts):
    single, burst = engines
    params = [
        {"max_new_tokens": 40, "temperature": 0, "regex": "[a-z ]{10,60}"},
        {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},  # free, in the same bursts
        {"max_new_tokens": 25, "temperature": 0, "regex": "(cat|dog|bird)( (cat|dog|bird)){0,20}"},
    ]
    prompts = ["The animals are", "Once upon a time", "List:"]
    expected = _run(single, prompts, params)
    assert not bursts
    got = _run(burst, prompts, params)
    assert got == expected
    assert max(_constrained_bursts(bursts), default=0) > 1, bursts
    assert any(all(rows) is False and any(rows) for rows, _ in bursts), (
        "constrained and free rows share a burst"
    )
    assert _pool_is_whole(burst)


def test_seeded_sampled_constrained_rows_give_the_tokens_of_single_steps(engines, bursts):
    single, burst = engines
    params = [
        {
            "max_new_tokens": 40,
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": 11,
            "regex": "[a-z]+( [a-z]+){3,12}",
        },
        {
            "max_new_tokens": 40,
            "temperature": 1.1,
            "top_k": 30,
            "seed": 12,
            "json_schema": json.dumps(SCHEMA),
        },
    ]
    prompts = ["Words:", "JSON:"]
    expected = _run(single, prompts, params)
    got = _run(burst, prompts, params)
    assert got == expected
    assert max(_constrained_bursts(bursts), default=0) > 1, bursts
    doc = json.loads(got[1][1])
    assert set(doc) == {"identifier", "description"}


def test_json_rows_end_bursts_at_forced_text_and_still_parse(engines, bursts):
    single, burst = engines
    params = {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    expected = _run(single, ["Record:"], [params])
    jumps_before = burst.stats().get("total_jump_forward_tokens")
    got = _run(burst, ["Record:"], [params])
    assert got == expected
    doc = json.loads(got[0][1])
    assert isinstance(doc["identifier"], int) and isinstance(doc["description"], str)
    if jumps_before is not None:
        assert burst.stats()["total_jump_forward_tokens"] > jumps_before
    assert _pool_is_whole(burst)


def test_closing_near_the_budget_matches_single_steps(engines, bursts):
    """A budget the model's free text would overrun: the burst stops where closing looks, and the
    request closes exactly as with one step at a time."""
    single, burst = engines
    schema = {
        "type": "object",
        "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
        "required": ["notes"],
    }
    for budget in (24, 48, 90):
        params = {"max_new_tokens": budget, "temperature": 0, "json_schema": json.dumps(schema)}
        expected = _run(single, ["Notes:"], [params])
        got = _run(burst, ["Notes:"], [params])
        assert got == expected, budget
        ids, text, finish, closed = got[0]
        assert len(ids) <= budget
        json.loads(text)  # closed early or finished: it parses
    assert _pool_is_whole(burst)
