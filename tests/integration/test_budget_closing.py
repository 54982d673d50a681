"""Budget-aware closing steers only as much as the budget needs: an output the model finishes
within its budget comes back unchanged, and one that would not fit still parses."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

FIXED_AND_BOUNDED = [
    {"regex": r"\d{4}-\d{2}-\d{2}"},
    {"regex": r"[a-z]{1,6}( [a-z]{1,6}){0,3}"},
    {"regex": r"(yes|no|maybe)\. [A-Z][a-z]{0,8}"},
    {
        "json_schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 10},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        }
    },
    {
        "json_schema": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 4,
        }
    },
    {
        "json_schema": {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 5},
                    "maxItems": 2,
                },
            },
            "required": ["ok"],
        }
    },
]


def _params(constraint: dict, budget: int) -> dict:
    params = {"max_new_tokens": budget, "temperature": 0}
    if "regex" in constraint:
        params["regex"] = constraint["regex"]
    else:
        params["json_schema"] = json.dumps(constraint["json_schema"])
    return params


def _valid(constraint: dict, text: str) -> bool:
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text, flags=re.ASCII) is not None
    try:
        jsonschema.validate(json.loads(text), constraint["json_schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _shortest(engine, prompt: str, constraint: dict) -> int:
    """The smallest budget the engine accepts for `constraint` (it refuses smaller ones)."""
    for budget in range(1, 64):
        try:
            engine.generate(prompt, _params(constraint, budget))
        except ValueError as exc:
            assert "max_new_tokens" in str(exc)
            continue
        return budget
    raise AssertionError("no budget under 64 accepted")


@pytest.mark.parametrize("constraint", FIXED_AND_BOUNDED, ids=lambda c: next(iter(c)))
@pytest.mark.parametrize("prompt", ["Answer:", "The record"])
def test_outputs_that_fit_their_budget_are_unchanged(tiny_engine, constraint, prompt):
    """At every budget from the shortest accepted to 16 more: where the model finishes within
    the budget by itself (closing off), closing on returns exactly that; elsewhere it returns
    output that validates, said to be closed."""
    shortest = _shortest(tiny_engine, prompt, constraint)
    budgets = list(range(shortest, shortest + 17))
    params = [_params(constraint, b) for b in budgets]
    free = tiny_engine.generate(
        [prompt] * len(budgets), [{**p, "budget_closing": False} for p in params]
    )
    outs = tiny_engine.generate([prompt] * len(budgets), params)
    fitted = 0
    for budget, own, out in zip(budgets, free, outs):
        meta = out["meta_info"]
        assert _valid(constraint, out["text"]), (budget, out["text"])
        assert meta["completion_tokens"] <= budget
        if own["meta_info"]["finish_reason"]["type"] == "stop":
            fitted += 1
            assert out["text"] == own["text"], (budget, out["text"], own["text"])
            assert out["output_ids"] == own["output_ids"], budget
            assert not meta["closed_early"], budget
        elif meta["closed_early"]:
            assert meta["finish_reason"]["type"] == "length"
    assert fitted, "the model finished within none of the budgets: nothing was compared"
    assert tiny_engine.stats()["kv_pages_in_use"] == 0


def test_a_steered_output_keeps_the_models_own_tokens_while_a_closing_fits(tiny_engine):
    """Under a budget too small for what the model writes, the output is the model's own text
    up to where a closing must start: a prefix of the unconstrained-by-budget output."""
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    params = {"max_new_tokens": 400, "temperature": 0, "json_schema": json.dumps(schema)}
    free = tiny_engine.generate("Note:", params)
    for budget in (12, 20, 30):
        out = tiny_engine.generate("Note:", {**params, "max_new_tokens": budget})
        text = out["text"]
        jsonschema.validate(json.loads(text), schema)
        if free["meta_info"]["completion_tokens"] > budget:
            assert out["meta_info"]["closed_early"]
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            kept = text[: text.rindex('"')]  # everything before the closing quote
            assert free["text"].startswith(kept), (text, free["text"])
            assert len(kept) > len('{"note": "'), text
