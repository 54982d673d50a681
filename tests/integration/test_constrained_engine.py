"""Constrained generation through the Engine: every finished output complies, constrained and
free requests share batches, jump-forward keeps ids canonical, bad constraints get named errors."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
REGEXES = json.loads((DATA / "regex_corpus.json").read_text())
SCHEMAS = json.loads((DATA / "schema_corpus.json").read_text())


def corpus_requests(seed: int) -> tuple[list[str], list[dict]]:
    prompts, params = [], []
    for i, r in enumerate(REGEXES):
        prompts.append(f"Pattern {r['name']}:")
        params.append(
            {"max_new_tokens": 96, "temperature": 1.0, "seed": seed + i, "regex": r["regex"]}
        )
    for i, s in enumerate(SCHEMAS):
        prompts.append(f"Schema {s['name']}:")
        params.append(
            {
                "max_new_tokens": 96,
                "temperature": 1.0,
                "seed": seed + i,
                "json_schema": json.dumps(s["schema"]),
            }
        )
    return prompts, params


def check_compliance(outs: list[dict]) -> int:
    finished = 0
    for spec, out in zip(REGEXES + SCHEMAS, outs):
        if out["meta_info"]["finish_reason"]["type"] != "stop":
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            continue
        finished += 1
        if "regex" in spec:
            assert re.fullmatch(spec["regex"], out["text"]), (spec["name"], out["text"])
        else:
            jsonschema.validate(json.loads(out["text"]), spec["schema"])
    return finished


def test_sampled_corpus_outputs_comply(tiny_engine):
    prompts, params = corpus_requests(seed=0)
    outs = tiny_engine.generate(prompts, params)  # one batch: every pattern at once
    assert check_compliance(outs) >= 0.6 * len(outs)


def test_compliance_without_jump_forward(tiny_llama_dir):
    from plait import Engine

    engine = Engine(
        model_path=str(tiny_llama_dir), max_total_tokens=16384, disable_jump_forward=True
    )
    try:
        prompts, params = corpus_requests(seed=100)
        outs = engine.generate(prompts, params)
        assert check_compliance(outs) >= 0.6 * len(outs)
        assert all(o["meta_info"]["jump_forward_tokens"] == 0 for o in outs)
    finally:
        engine.shutdown()


def test_mixed_batch_rows_equal_running_alone(tiny_engine):
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["a"],
        }
    )
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    items = [
        ("free one", greedy),
        ("a date", {**greedy, "ignore_eos": False, "regex": r"\d{4}-\d{2}-\d{2}"}),
        ("free two is longer than the others", greedy),
        ("json", {**greedy, "ignore_eos": False, "json_schema": schema}),
    ]
    alone = [tiny_engine.generate(p, sp) for p, sp in items]
    together = tiny_engine.generate([p for p, _ in items], [sp for _, sp in items])
    assert [o["output_ids"] for o in together] == [o["output_ids"] for o in alone]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", together[1]["text"])
    assert 0 <= json.loads(together[3]["text"])["a"] <= 999


def test_jump_forward_ids_are_the_tokenizers_encoding(tiny_engine):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "kind": {"enum": ["administrator", "user"]},
            "active": {"type": "boolean"},
        },
        "required": ["name", "kind", "active"],
    }
    tok = tiny_engine.tokenizer
    jumped = 0
    for seed in range(4):
        out = tiny_engine.generate(
            f"Person {seed}:",
            # compact: every space is forced, none is the sampler's own (which it may split)
            {
                "max_new_tokens": 64,
                "temperature": 1.0,
                "seed": seed,
                "json_schema": json.dumps(schema),
                "json_whitespace": "compact",
            },
        )
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(out["text"]), schema)
        ids = [t for t in out["output_ids"] if t not in tok.eos_token_ids]
        assert ids == tok.encode(out["text"], add_special_tokens=False)
        jumped += out["meta_info"]["jump_forward_tokens"]
    assert jumped > 0


@pytest.mark.parametrize(
    "params, match",
    [
        ({"regex": "(unclosed"}, "regex"),
        ({"json_schema": "{not json"}, "json_schema"),
        (
            {
                "json_schema": json.dumps(
                    {"type": "object", "properties": {"x": {"not": {"pattern": "^a"}}}}
                )
            },
            "'not' at #/properties/x is not supported",
        ),
        ({"regex": "a", "json_schema": "{}"}, "at most one"),
        ({"regex": 5}, "regex"),
    ],
)
def test_bad_constraints_are_named_and_engine_survives(tiny_engine, params, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine.generate("x", {"max_new_tokens": 4, **params})
    assert (
        tiny_engine.generate("x", {"max_new_tokens": 2, "regex": "[ab]+"})["meta_info"][
            "completion_tokens"
        ]
        >= 1
    )
    assert tiny_engine.stats()["kv_pages_in_use"] == 0


def test_closing_searches_are_few_per_request(tiny_engine, monkeypatch):
    """Near its budget a constrained request looks for its closing a few times (the gap to the
    budget shrinks by a third between looks), not on every step; once it steers, at most one
    search a step runs on the engine loop, and only for a room of 40 tokens or less; what it
    returns validates."""
    from plait.runtime.constrained import closing

    calls = []
    search = closing.ClosingSearch.shortest_completion

    def counted(self, grammar, max_tokens, time_limit=0.05):
        calls.append((max_tokens, threading.current_thread().name))
        return search(self, grammar, max_tokens, 10.0)  # bounded by expansions, not a loaded CPU

    monkeypatch.setattr(closing.ClosingSearch, "shortest_completion", counted)
    tail = {f"closing_property_number_{i}": {"type": "string"} for i in range(4)}
    schema = {
        "type": "object",
        "properties": {"notes": {"type": "array", "items": {"type": "string"}}, **tail},
        "required": ["notes", *tail],
    }
    budget = 160
    outs = tiny_engine.generate(
        ["Notes:"] * 3,
        [
            {
                "max_new_tokens": budget,
                "temperature": 1.0,
                "seed": s,
                "json_schema": json.dumps(schema),
            }
            for s in range(3)
        ],
    )
    for out in outs:
        jsonschema.validate(json.loads(out["text"]), schema)
    closed = sum(bool(o["meta_info"]["closed_early"]) for o in outs)
    assert closed >= 1
    looks = [room for room, name in calls if not name.startswith("plait-engine")]
    assert len(looks) <= 3 * 24, calls  # each request: its probe and a few looks near the end
    # closings this long are looked for off the engine loop, their request waiting meanwhile
    assert any(name.startswith("plait-closing") for _, name in calls), calls
    steering = [room for room, name in calls if name.startswith("plait-engine")]
    assert all(room <= 40 for room in steering), calls
    assert len(steering) <= 3 * 41, calls  # the room shrinks by one a step


def test_budget_below_a_long_shortest_instance_is_refused(tiny_engine):
    """The submit probe finds a shortest instance of hundreds of tokens, so a budget below it is
    refused by name before the request is queued, and one above it closes valid."""
    props = {f"requiredPropertyNumber{i}": {"type": "integer"} for i in range(40)}
    schema = json.dumps({"type": "object", "properties": props, "required": list(props)})
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_engine.generate("x", {"max_new_tokens": 100, "json_schema": schema})
    assert tiny_engine.stats()["kv_pages_in_use"] == 0
    out = tiny_engine.generate(
        "x", {"max_new_tokens": 400, "temperature": 1.0, "seed": 1, "json_schema": schema}
    )
    jsonschema.validate(json.loads(out["text"]), json.loads(schema))


def test_tight_budgets_with_optional_properties_close_valid(tiny_engine):
    """A budget a little above the shortest instance, optional properties the sampler may open
    (and jump-forward may run through): every output parses and validates."""
    optional = {f"optionalField{i}": {"type": ["string", "null"]} for i in range(8)}
    required = {
        f"requiredField{i}": {"type": "string"} for i in range(8)
    }  # a closing looked for off the loop
    schema = {
        "type": "object",
        "properties": {**optional, **required},
        "required": list(required),
        "additionalProperties": False,
    }
    text = json.dumps(schema)
    outs = tiny_engine.generate(
        ["Device:"] * 8,
        [
            {"max_new_tokens": 72, "temperature": 1.0, "seed": s, "json_schema": text}
            for s in range(8)
        ],
    )
    for out in outs:
        jsonschema.validate(json.loads(out["text"]), schema)
    assert tiny_engine.stats()["kv_pages_in_use"] == 0
