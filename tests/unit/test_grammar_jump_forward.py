"""Jump-forward: forced strings from the index (checked against interegular's character FSM),
retokenization equal to the tokenizer's encoding, and walks that jump stay valid."""

from __future__ import annotations

import json
import re

import interegular
import jsonschema
import pytest
from interegular.fsm import anything_else

from plait.runtime.constrained import jump_forward, make_grammar_key, retokenize
from tests.unit.grammar_support import compile_key, random_walk, regex_corpus, schema_corpus

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "role": {"enum": ["administrator", "user"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "role", "age"],
}


def corpus_schema(name: str) -> dict:
    return next(e["schema"] for e in schema_corpus() if e["name"] == name)


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_forced_strings_of_a_compact_schema(tok):
    grammar = compile_key(
        tok, make_grammar_key(json_schema=PERSON, json_whitespace="compact")
    ).new_grammar()
    assert grammar.try_jump_forward() == '{"name":"'
    jump = jump_forward(grammar, tok)
    assert jump.text == '{"name":"' and jump.num_dropped == 0
    assert list(grammar.token_ids) == ids(tok, '{"name":"')
    assert grammar.try_jump_forward() is None  # free text inside the string
    for t in ids(tok, 'Ann"'):
        grammar.advance(t)
    assert grammar.try_jump_forward() == ',"role":"'
    jump = jump_forward(grammar, tok)
    assert jump.num_dropped == 1  # the lone `"` merges with what follows
    assert list(grammar.token_ids) == ids(tok, '{"name":"Ann","role":"')
    grammar.advance(ids(tok, "a")[0])
    assert grammar.try_jump_forward() == 'dministrator","age":'
    jump_forward(grammar, tok)
    assert tok.decode(list(grammar.token_ids)) == '{"name":"Ann","role":"administrator","age":'
    for t in ids(tok, "42}"):
        grammar.advance(t)
    assert grammar.accepts_eos() and grammar.is_terminated() and grammar.try_jump_forward() is None


def test_optional_spaces_force_only_the_brace(tok):
    """outlines-core spaces JSON conventionally with an optional space between JSON tokens, so
    only the brace is forced at the start."""
    key = make_grammar_key(json_schema=PERSON, json_whitespace="conventional")
    grammar = compile_key(tok, key).new_grammar()
    assert grammar.try_jump_forward() == "{"
    assert jump_forward(grammar, tok) is None  # below min_chars
    assert jump_forward(grammar, tok, min_chars=1).text == "{"


def test_forced_text_stops_at_accepting_states_and_char_boundaries(tok):
    grammar = compile_key(tok, make_grammar_key(regex="abc(de)?")).new_grammar()
    assert grammar.try_jump_forward() == "abc"
    jump_forward(grammar, tok)
    assert grammar.accepts_eos() and not grammar.is_terminated()
    grammar = compile_key(tok, make_grammar_key(choices=["日本語です"])).new_grammar()
    assert grammar.try_jump_forward() == "日本語です"
    grammar.advance(ids(tok, "日本語です")[0])  # b"\xe6\x97": the output ends inside a character
    assert grammar.try_jump_forward() is None
    grammar = compile_key(tok, make_grammar_key(choices=["café", "cafè"])).new_grammar()
    assert grammar.try_jump_forward() == "caf"  # é and è share their first byte only


@pytest.mark.parametrize(
    "before,forced",
    [
        ("", '{"a":'),
        ("{", '"name":"'),
        ('{"x":"Bo', 'b","y":'),
        ("hello wor", "ld"),
        ("[1,2", ",3]"),
        ("naï", "ve"),
        ("Il était", " une fois"),
    ],
)
def test_retokenize_equals_the_tokenizer(tok, before, forced):
    old = ids(tok, before)
    edit = retokenize(tok, old, forced)
    new = old[: len(old) - edit.num_dropped] + edit.new_token_ids
    assert new == ids(tok, before + forced)
    assert edit.num_dropped <= 2


def interegular_forced(fsm, text: str) -> str | None:
    state = fsm.initial
    for ch in text:
        state = fsm.map[state].get(fsm.alphabet[ch])
        if state is None:
            return None
    out = []
    while state not in fsm.finals and len(fsm.map[state]) == 1:
        ((symbol, state),) = fsm.map[state].items()
        chars = fsm.alphabet.by_transition[symbol]
        if len(chars) != 1 or chars[0] is anything_else:
            break
        out.append(chars[0])
    return "".join(out)


CROSS_CHECK = [
    "weekday",
    "date_iso",
    "ipv4",
    "semver",
    "iso_time_tz",
    "unicode_words",
    "key_value_json",
    "roman_numeral",
]


@pytest.mark.parametrize(
    "pattern",
    [
        pytest.param(("regex", e["regex"]), id=e["name"])
        for e in regex_corpus()
        if e["name"] in CROSS_CHECK
    ]
    + [
        pytest.param(("json_schema", PERSON), id="person"),
        pytest.param(("json_schema", corpus_schema("object_const_enum")), id="const_enum"),
    ],
)
def test_forced_strings_match_interegular(tok, pattern):
    kind, spec = pattern
    compiled = compile_key(tok, make_grammar_key(**{kind: spec}))
    fsm = interegular.parse_pattern(compiled.regex).to_fsm().reduce()
    checked = 0
    for seed in range(4):
        walk = random_walk(compiled, tok, seed)
        grammar = compiled.new_grammar()
        for step in range(len(walk.token_ids) + 1):
            text = b"".join(compiled.backend.token_bytes[t] for t in walk.token_ids[:step])
            try:
                prefix = text.decode("utf-8")
            except UnicodeDecodeError:  # mid-character: no jump there
                assert grammar.try_jump_forward() is None
            else:
                assert (grammar.try_jump_forward() or "") == interegular_forced(fsm, prefix), prefix
                checked += 1
            if step < len(walk.token_ids):
                grammar.advance(walk.token_ids[step])
    assert checked > 10


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(e, id=e["name"], marks=[pytest.mark.slow] if e.get("slow") else [])
        for e in schema_corpus()
    ],
)
def test_walks_with_jump_forward_stay_valid(tok, entry):
    schema = entry["schema"]
    compiled = compile_key(tok, make_grammar_key(json_schema=schema))
    validator = jsonschema.validators.validator_for(schema)(schema)
    walk = random_walk(compiled, tok, seed=11, use_jump_forward=True)  # checks ids == encode(text)
    assert walk.finished
    assert not list(validator.iter_errors(json.loads(walk.text))), walk.text
    assert re.fullmatch(compiled.regex, walk.text)


def test_walks_with_jump_forward_jump(tok):
    compiled = compile_key(tok, make_grammar_key(json_schema=corpus_schema("extraction_8_fields")))
    walk = random_walk(compiled, tok, seed=3, use_jump_forward=True)
    assert walk.finished and walk.jumps >= 8  # every key, at least
