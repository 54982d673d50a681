"""Constrained generation on the embedded model: greedy outputs of the corpora comply."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

pytestmark = pytest.mark.e2e

DATA = Path(__file__).resolve().parents[1] / "data"
REGEXES = json.loads((DATA / "regex_corpus.json").read_text())
SCHEMAS = json.loads((DATA / "schema_corpus.json").read_text())


def chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_greedy_corpus_on_the_real_model(default_engine):
    prompts, params = [], []
    for r in REGEXES:
        prompts.append(
            chat(default_engine, f"Write one example of: {r['name'].replace('_', ' ')}.")
        )
        params.append({"max_new_tokens": 48, "temperature": 0, "regex": r["regex"]})
    for s in SCHEMAS:
        prompts.append(chat(default_engine, f"Reply with JSON for: {s['name'].replace('_', ' ')}."))
        params.append(
            {"max_new_tokens": 128, "temperature": 0, "json_schema": json.dumps(s["schema"])}
        )
    outs = default_engine.generate(prompts, params)
    finished = 0
    for spec, out in zip(REGEXES + SCHEMAS, outs):
        if out["meta_info"]["finish_reason"]["type"] != "stop":
            continue
        finished += 1
        if "regex" in spec:
            assert re.fullmatch(spec["regex"], out["text"]), (spec["name"], out["text"])
        else:
            jsonschema.validate(json.loads(out["text"]), spec["schema"])
    assert finished >= 0.6 * len(outs)  # the rest ran to max_new_tokens (e.g. endless digits)


def test_extraction_with_and_without_jump_forward(default_engine):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "city": {"type": "string", "maxLength": 30},
        },
        "required": ["name", "age", "city"],
    }
    prompt = chat(default_engine, "Extract the person as JSON: Maria Lopez, 34, lives in Madrid.")
    out = default_engine.generate(
        prompt, {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(schema)}
    )
    person = json.loads(out["text"])
    jsonschema.validate(person, schema)
    assert person["age"] == 34 and "Madrid" in person["city"]
    assert out["meta_info"]["jump_forward_tokens"] > 0
    ids = [t for t in out["output_ids"] if t not in default_engine.tokenizer.eos_token_ids]
    assert ids == default_engine.tokenizer.encode(out["text"], add_special_tokens=False)


def test_a_date_that_fits_its_budget_is_the_models_own(default_engine):
    """The model's own ISO date comes back at every budget that holds it: closing never swaps in
    a canned completion, and `\\d` writes ASCII digits only."""
    prompt = chat(default_engine, "What is today's date? Answer as YYYY-MM-DD.")
    params = {"regex": r"\d{4}-\d{2}-\d{2}", "temperature": 0}
    own = default_engine.generate(prompt, {**params, "max_new_tokens": 64})
    assert own["meta_info"]["finish_reason"]["type"] == "stop"
    needed = own["meta_info"]["completion_tokens"]
    budgets = list(range(needed, needed + 17))
    outs = default_engine.generate(
        [prompt] * len(budgets), [{**params, "max_new_tokens": b} for b in budgets]
    )
    for budget, out in zip(budgets, outs):
        assert out["text"] == own["text"], (budget, out["text"], own["text"])
        assert not out["meta_info"]["closed_early"]
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", out["text"])
