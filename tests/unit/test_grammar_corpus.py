"""Every corpus regex and schema compiles, accepts its known-good examples, and random walks over
its masks only ever produce text that matches / validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from plait.runtime.constrained import make_grammar_key
from tests.unit.grammar_support import compile_key, random_walk, regex_corpus, schema_corpus

SEEDS = (0, 1, 2)


def _params(corpus):
    return [
        pytest.param(e, id=e["name"], marks=[pytest.mark.slow] if e.get("slow") else [])
        for e in corpus()
    ]


def test_corpus_sizes():
    assert len(regex_corpus()) >= 30
    assert len(schema_corpus()) >= 30
    for entry in regex_corpus():
        for example in entry["examples"]:
            assert re.fullmatch(entry["regex"], example), entry["name"]


def _accepts(compiled, tokenizer, text: str) -> bool:
    grammar = compiled.new_grammar()
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return all(grammar.try_advance(t) for t in token_ids) and grammar.accepts_eos()


@pytest.mark.parametrize("entry", _params(regex_corpus))
def test_regex_corpus(entry, smollm_tokenizer):
    compiled = compile_key(smollm_tokenizer, make_grammar_key(regex=entry["regex"]))
    for example in entry["examples"]:
        assert _accepts(compiled, smollm_tokenizer, example), example
    for seed in SEEDS:
        walk = random_walk(compiled, smollm_tokenizer, seed, check_every=7 if seed == 0 else 0)
        assert walk.finished, f"no EOS within the step cap: {walk.text!r}"
        assert re.fullmatch(entry["regex"], walk.text), walk.text
        assert smollm_tokenizer.decode(walk.token_ids) == walk.text


@pytest.mark.parametrize("entry", _params(schema_corpus))
def test_schema_corpus(entry, smollm_tokenizer):
    schema = entry["schema"]
    compiled = compile_key(smollm_tokenizer, make_grammar_key(json_schema=schema))
    for instance in entry["valid"]:
        compact = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
        assert _accepts(compiled, smollm_tokenizer, compact), compact
    validator = jsonschema.validators.validator_for(schema)(schema)
    for seed in SEEDS:
        walk = random_walk(compiled, smollm_tokenizer, seed, check_every=7 if seed == 0 else 0)
        assert walk.finished, f"no EOS within the step cap: {walk.text!r}"
        instance = json.loads(walk.text)
        errors = [e.message for e in validator.iter_errors(instance)]
        assert not errors, (walk.text, errors)
        assert re.fullmatch(compiled.regex, walk.text), walk.text
