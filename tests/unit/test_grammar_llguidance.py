"""The llguidance backend on the SmolLM2 tokenizer: context-free grammars (Lark, GBNF), the
schemas a regex automaton refused, unknown formats, errors that name the keyword and its place,
runaway bounds, and budget-aware closing: every walk cut short and closed validates."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.kernels.constraint_mask import allocate_token_bitmask
from plait.runtime.constrained import GrammarError, UnsupportedSchemaError, make_grammar_key
from plait.runtime.constrained.closing import ClosingSearch
from plait.runtime.constrained.llguidance_backend import LLGuidanceBackend
from tests.unit.grammar_support import allowed_ids, schema_corpus

# What the regex/DFA path refused (state limits, keywords), each with a valid example.
COVERAGE = {
    "long repetition": {"type": "string", "pattern": "^[a-z]{3,2000}$"},
    "pattern with lengths": {
        "type": "string",
        "pattern": "^[a-z]+$",
        "minLength": 3,
        "maxLength": 6,
    },
    "minProperties": {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "integer"},
            "c": {"type": "integer"},
        },
        "minProperties": 2,
    },
    "patternProperties": {
        "type": "object",
        "patternProperties": {"^x_[a-z]+$": {"type": "integer"}},
        "additionalProperties": False,
    },
    "allOf of several": {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ]
    },
    "oneOf disjoint": {"oneOf": [{"type": "string", "maxLength": 4}, {"type": "integer"}]},
    "uniqueItems": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
    "unknown format": {"type": "string", "format": "x-telephone", "maxLength": 12},
    "number bounds": {"type": "number", "minimum": -2.5, "maximum": 10.25},
    "multipleOf": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100},
    "dependencies": {
        "type": "object",
        "properties": {"card": {"type": "integer"}, "billing": {"type": "string", "maxLength": 5}},
        "dependencies": {"card": ["billing"]},
    },
    "properties beside anyOf branches": {
        "type": "object",
        "properties": {"ast": {"enum": ["BUILD", "SKIP"]}, "type": {"type": "string"}},
        "required": ["ast", "type"],
        "anyOf": [
            {"properties": {"type": {"const": "RULE"}, "data": {"type": "integer"}}},
            {"properties": {"type": {"const": "WILDCARD"}}},
        ],
    },
    "a definition combined with properties": {
        "type": "object",
        "properties": {"k": {"type": "string", "maxLength": 3}},
        "required": ["k"],
        "anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
        "$defs": {
            "A": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
            "B": {"type": "object", "properties": {"y": {"type": "boolean"}}, "required": ["y"]},
        },
    },
    "allOf beside properties": {
        "type": "object",
        "properties": {"k": {"type": "boolean"}},
        "required": ["k"],
        "allOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}],
    },
    "required but not listed": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a", "b"],
    },
    "schema dependencies": {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "boolean"},
            "c": {"type": "integer"},
        },
        "required": ["c"],
        "dependencies": {"a": {"required": ["b"]}, "c": {"properties": {"b": {"const": True}}}},
    },
    "not required": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "not": {"required": ["b"]},
    },
    "not a type": {
        "anyOf": [{"type": "string", "maxLength": 3}, {"type": "array"}],
        "not": {"type": "array"},
    },
    "a property that never validates": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"not": {}}},
    },
    "discriminated oneOf": {
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
        "$defs": {
            "Cat": {
                "type": "object",
                "properties": {"pet": {"const": "cat"}, "lives": {"type": "integer"}},
                "required": ["pet"],
            },
            "Dog": {
                "type": "object",
                "properties": {"pet": {"const": "dog"}, "lives": {"type": "integer"}},
                "required": ["pet"],
            },
        },
    },
    "big schema": {
        "type": "object",
        "properties": {f"field_{i}_{'x' * 40}": {"type": "integer"} for i in range(700)},
        "required": ["field_0_" + "x" * 40],
    },
}


@pytest.fixture(scope="module")
def backend(smollm_tokenizer) -> LLGuidanceBackend:
    return LLGuidanceBackend(smollm_tokenizer, max_digit_run=24, max_whitespace_run=16)


@pytest.fixture(scope="module")
def closing(smollm_tokenizer) -> ClosingSearch:
    tok = smollm_tokenizer
    return ClosingSearch(
        tok.vocab_bytes(), (tok.vocab_size + 31) // 32, tok.special_token_ids | tok.eos_token_ids
    )


def walk_then_close(
    backend, closing, key, seed: int, steps: int, required: bool = True
) -> str | None:
    """Samples uniformly among allowed tokens for `steps` tokens (or until EOS is the only way
    on), then closes with the budget search; returns the text, which the grammar accepts (None
    when the search found no closing and `required` is off)."""
    rng = np.random.default_rng(seed)
    grammar = backend.compile(key).new_grammar()
    eos = set(backend.eos_token_ids)
    bitmask = allocate_token_bitmask(1, backend.vocab_size)
    for _ in range(steps):
        if grammar.is_terminated():
            break
        grammar.fill_bitmask(bitmask, 0)
        allowed = [t for t in allowed_ids(bitmask[0]).tolist() if t not in eos]
        if not allowed:
            break
        grammar.advance(int(rng.choice(allowed)))
    tail = closing.shortest_completion(grammar, max_tokens=256)
    if tail is None and not required:
        return None
    assert tail is not None, backend.tokenizer.decode(list(grammar.token_ids))
    for t in tail:
        grammar.advance(t)
    assert grammar.accepts_eos()
    return b"".join(backend.tokenizer.token_bytes(t) for t in grammar.token_ids).decode()


@pytest.mark.parametrize("name", list(COVERAGE))
def test_schemas_the_automaton_refused_compile_and_close_valid(backend, closing, name):
    schema = COVERAGE[name]
    key = make_grammar_key(json_schema=schema)
    for seed in range(6):
        text = walk_then_close(backend, closing, key, seed, steps=4 * seed)
        jsonschema.validate(json.loads(text), schema)


def test_budget_closed_corpus_outputs_validate(backend, closing):
    """Every closed output validates; the search closes nearly every walk (it is bounded, and
    a string deep inside a format such as `email` can outlast it)."""
    closed = tried = 0
    for entry in schema_corpus():
        key = make_grammar_key(json_schema=entry["schema"])
        for seed in range(3):
            tried += 1
            text = walk_then_close(backend, closing, key, seed, 3 + 7 * seed, required=False)
            if text is not None:
                closed += 1
                jsonschema.validate(json.loads(text), entry["schema"])
    assert closed >= 0.85 * tried, (closed, tried)


def test_closings_longer_than_the_first_pass_are_found(backend, closing):
    """The shallow pass of the search does not spend what the deeper one needs: a closing of
    40-odd tokens from the start of an envelope-like schema is found."""
    schema = {
        "type": "object",
        "properties": {
            "commandId": {"type": "string"},
            "execution": {
                "type": "object",
                "properties": {
                    "semantics": {"enum": ["AT_LEAST_ONCE"]},
                    "timeToLive": {"type": ["integer", "null"]},
                },
                "required": ["semantics", "timeToLive"],
            },
            "tags": {"type": "object", "additionalProperties": {"type": "string"}},
            "whenCreated": {"type": "string"},
        },
        "required": ["commandId", "whenCreated", "execution", "tags"],
    }
    grammar = backend.compile(make_grammar_key(json_schema=schema)).new_grammar()
    tail = closing.shortest_completion(grammar, 4096, time_limit=30)
    assert tail is not None and len(tail) > 32
    jsonschema.validate(json.loads(backend.tokenizer.decode(tail)), schema)


def test_closings_of_hundreds_of_tokens_are_found(backend, closing):
    """A schema with dozens of required properties closes in hundreds of tokens: more than the
    backtracking passes can follow, found by walking the first path out."""
    props = {f"requiredPropertyNumber{i}": {"type": "integer"} for i in range(40)}
    schema = {"type": "object", "properties": props, "required": list(props)}
    grammar = backend.compile(make_grammar_key(json_schema=schema)).new_grammar()
    tail = closing.shortest_completion(grammar, 4096, time_limit=30)
    assert tail is not None and len(tail) > 200
    jsonschema.validate(json.loads(backend.tokenizer.decode(tail)), schema)


EMAIL = {
    "type": "string",
    "format": "email",
    "pattern": "^[A-Za-z0-9_\\-\\.]+@[A-Za-z0-9_\\-\\.]+\\.[A-Za-z]{2,}$",
}


@pytest.mark.parametrize(
    "written", ['{"contact":{"email":"', '{"contact":{"email":"mara', '{"contact":{"email":"a@b.']
)
def test_closings_end_patterns_that_end_in_letters(backend, closing, written):
    """An email pattern ending in `\\.[A-Za-z]{2,}$` inside a longer document: walks that try
    digits first write them after every dot, which that end never takes; one walk tries letters
    first."""
    props = {f"field{i}": {"type": "string"} for i in range(12)}
    schema = {
        "type": "object",
        "required": ["contact", *props],
        "properties": {
            "contact": {"type": "object", "required": ["email"], "properties": {"email": EMAIL}},
            **props,
        },
    }
    key = make_grammar_key(json_schema=schema, json_whitespace="compact")
    grammar = backend.compile(key).new_grammar()
    assert all(grammar.try_advance(t) for t in backend.tokenizer.encode(written))
    tail = closing.shortest_completion(grammar, 4096, time_limit=5)
    assert tail is not None, written
    value = json.loads(written + backend.tokenizer.decode(tail))
    jsonschema.validate(value, schema)


def test_closings_take_separators_in_turn(backend, closing):
    """A pattern whose groups allow `-` but end at `:`: the walk must not write `-` forever."""
    pattern = "^pbj:([a-z0-9-]+):([a-z0-9\\.-]+):([a-z0-9-]+)?:([a-z0-9-]+):([0-9]+-[0-9]+-[0-9]+)$"
    schema = {
        "type": "object",
        "required": ["_schema"],
        "additionalProperties": False,
        "properties": {"_schema": {"type": "string", "pattern": pattern}},
    }
    grammar = backend.compile(make_grammar_key(json_schema=schema)).new_grammar()
    tail = closing.shortest_completion(grammar, 4096, time_limit=5)
    assert tail is not None
    jsonschema.validate(json.loads(backend.tokenizer.decode(tail)), schema)


def test_only_declared_properties_by_default(backend, closing):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    key = make_grammar_key(json_schema=schema)
    for seed in range(8):
        assert set(json.loads(walk_then_close(backend, closing, key, seed, 12))) <= {"a"}


@pytest.mark.parametrize(
    "grammar,language",
    [
        # balanced parentheses: no regex can say this
        ('root ::= "(" root ")" | "x"', r"(\(*)x(\)*)"),
        ('start: "(" start ")" | "x"', r"(\(*)x(\)*)"),
        (
            'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"',
            None,
        ),
    ],
)
def test_context_free_grammars(backend, closing, grammar, language):
    key = make_grammar_key(grammar=grammar)
    assert key.kind == "grammar"
    for seed in range(8):
        text = walk_then_close(backend, closing, key, seed, steps=2 + 3 * seed)
        if language:
            m = re.fullmatch(language, text)
            assert m and len(m.group(1)) == len(m.group(2)), text
        else:  # arithmetic: Python evaluates it the same way
            assert re.fullmatch(r"[0-9+()]+", text), text
            assert isinstance(eval(re.sub(r"\b0+(?=[0-9])", "", text)), int), text


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            {"json_schema": {"type": "object", "properties": {"x": {"not": {"pattern": "^a"}}}}},
            "'not' at #/properties/x is not supported",
        ),
        (
            {"json_schema": {"type": "array", "uniqueItems": True, "minItems": 2}},
            "'uniqueItems' at # is not supported",
        ),
        (
            {"json_schema": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}},
            "'oneOf' at # has alternatives that may overlap",
        ),
        ({"regex": "(unclosed"}, "regex: cannot compile"),
        ({"grammar": "start: nothing_defined"}, "grammar: "),
        ({"grammar": "root ::= (("}, "grammar: "),
        ({"grammar": 'start: "' + "a" * 300_000 + '"'}, "grammar: 300009 characters; the limit is"),
    ],
)
def test_errors_name_the_problem(backend, spec, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        backend.compile(make_grammar_key(**spec))


def test_unsupported_is_a_schema_error(backend):
    with pytest.raises(UnsupportedSchemaError):
        backend.compile(make_grammar_key(json_schema={"if": {"type": "string"}, "then": {}}))


def test_runaway_digits_and_whitespace_are_bounded(backend, smollm_tokenizer):
    tok = smollm_tokenizer
    digit = tok.encode("1", add_special_tokens=False)[0]
    grammar = backend.compile(make_grammar_key(json_schema={"type": "number"})).new_grammar()
    bitmask = allocate_token_bitmask(1, backend.vocab_size)
    for _ in range(24):
        grammar.fill_bitmask(bitmask, 0)
        assert digit in allowed_ids(bitmask[0])
        grammar.advance(digit)
    grammar.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask[0]).tolist()
    assert digit not in allowed and tok.eos_token_id in allowed and allowed
    # a pattern that needs the digits keeps them
    need = make_grammar_key(json_schema={"type": "string", "pattern": "^[0-9]{40}$"})
    grammar = backend.compile(need).new_grammar()
    grammar.advance(tok.encode('"', add_special_tokens=False)[0])
    for _ in range(30):
        grammar.advance(digit)
    grammar.fill_bitmask(bitmask, 0)
    assert digit in allowed_ids(bitmask[0])
    # whitespace, with a pattern that allows long runs
    wide = LLGuidanceBackend(tok, max_whitespace_run=4)
    key = make_grammar_key(
        json_schema={"type": "object", "properties": {"a": {"type": "integer"}}},
        json_whitespace="flexible",
    )
    grammar = wide.compile(key).new_grammar()
    space = tok.encode(" ", add_special_tokens=False)[0]
    grammar.advance(tok.encode("{", add_special_tokens=False)[0])
    for _ in range(4):
        grammar.advance(space)
    grammar.fill_bitmask(bitmask, 0)
    assert space not in allowed_ids(bitmask[0])


def test_jump_forward_and_rollback(backend, smollm_tokenizer):
    tok = smollm_tokenizer
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    grammar = backend.compile(make_grammar_key(json_schema=schema)).new_grammar()
    assert grammar.try_jump_forward() == '{"name": "'
    ids = tok.encode('{"name": "Al"}', add_special_tokens=False)
    for t in ids:
        grammar.advance(t)
    assert grammar.accepts_eos() and grammar.is_terminated()
    grammar.rollback(len(ids))
    assert grammar.try_jump_forward() == '{"name": "' and not grammar.token_ids


@pytest.mark.parametrize(
    "spacing, text",
    [
        ("conventional", '{"a": 1, "b": [2, 3]}'),
        ("compact", '{"a":1,"b":[2,3]}'),
        ("flexible", '{\n  "a": 1,\n  "b": [2, 3]\n}'),
    ],
)
def test_json_spacing(backend, smollm_tokenizer, spacing, text):
    """Each spacing accepts its own way of writing JSON and not the others' (flexible takes
    them all)."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    texts = ['{"a": 1, "b": [2, 3]}', '{"a":1,"b":[2,3]}', '{\n  "a": 1,\n  "b": [2, 3]\n}']
    grammar = backend.compile(
        make_grammar_key(json_schema=schema, json_whitespace=spacing)
    ).new_grammar()
    for other in texts:
        accepted = grammar.accepts_after(smollm_tokenizer.encode(other, add_special_tokens=False))
        assert accepted == (other == text or spacing == "flexible"), (spacing, other)


def _leaf() -> st.SearchStrategy[dict]:
    return st.sampled_from(
        [
            {"type": "string"},
            {"type": "string", "maxLength": 8},
            {"type": "string", "minLength": 2},
            {"type": "integer"},
            {"type": "integer", "minimum": -5, "maximum": 500},
            {"type": "number"},
            {"type": "number", "minimum": 0, "maximum": 1},
            {"type": "boolean"},
            {"type": "null"},
            {"enum": ["red", "green", 3, None]},
            {"const": "fixed"},
            {"type": "string", "format": "date"},
            {"type": "string", "format": "email"},
            {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
            {"type": ["string", "integer"]},
        ]
    )


def _schemas() -> st.SearchStrategy[dict]:
    """Shapes real-world schemas have: nested objects with required and optional properties,
    arrays with bounds, anyOf, allOf of objects, $defs with $ref."""

    def extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        names = st.lists(
            st.sampled_from(["id", "name", "kind", "tags", "meta", "value"]),
            min_size=1,
            max_size=4,
            unique=True,
        )
        obj = st.builds(
            lambda ks, vs, n: {
                "type": "object",
                "properties": dict(zip(ks, vs)),
                "required": ks[:n],
            },
            names,
            st.lists(children, min_size=4, max_size=4),
            st.integers(0, 4),
        )
        arr = st.builds(
            lambda c, lo: {"type": "array", "items": c, "minItems": lo, "maxItems": lo + 3},
            children,
            st.integers(0, 2),
        )
        any_of = st.builds(lambda a, b: {"anyOf": [a, b]}, children, children)
        all_of = st.builds(
            lambda a, b: {
                "allOf": [
                    {"type": "object", "properties": {"x": a}, "required": ["x"]},
                    {"type": "object", "properties": {"y": b}},
                ]
            },
            children,
            children,
        )
        return st.one_of(obj, arr, any_of, all_of)

    base = st.recursive(_leaf(), extend, max_leaves=12)
    return st.one_of(
        base,
        st.builds(
            lambda d: {"$defs": {"item": d}, "type": "array", "items": {"$ref": "#/$defs/item"}},
            base,
        ),
    )


@settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(schema=_schemas(), seed=st.integers(0, 1000), steps=st.integers(0, 40))
def test_generated_schemas_finished_or_closed_validate(backend, closing, schema, seed, steps):
    """Whatever a generated schema compiles to, an output that finished (EOS allowed) or was
    closed by the budget search validates with jsonschema."""
    try:
        key = make_grammar_key(json_schema=schema)
        backend.compile(key)
    except GrammarError:
        return  # refused by name: fine, as long as it is a GrammarError
    text = walk_then_close(backend, closing, key, seed, steps, required=False)
    if text is not None:
        # NOTE: formats as annotations (jsonschema's default): llguidance's `date` admits year
        # 0000, which RFC 3339's grammar allows and Python's date type does not
        jsonschema.validate(json.loads(text), schema)


def test_batch_fill_equals_row_by_row(backend, smollm_tokenizer):
    from plait.runtime.constrained.base import fill_bitmasks

    tok = smollm_tokenizer
    grammars = []
    for spec, text in [
        ({"json_schema": {"type": "number"}}, "1" * 30),  # bounded row
        ({"regex": "[a-z]+@[a-z]+"}, "ab"),
        ({"grammar": 'root ::= "(" root ")" | "x"'}, "(("),
        ({"regex": "ab"}, "ab"),  # terminated: EOS only
    ]:
        g = backend.compile(make_grammar_key(**spec)).new_grammar()
        for t in tok.encode(text, add_special_tokens=False):
            g.advance(t)
        grammars.append(g)
    grammars.insert(1, None)  # an unconstrained row in between stays untouched
    together = allocate_token_bitmask(len(grammars), backend.vocab_size)
    assert fill_bitmasks(grammars, together) == [0, 2, 3, 4]
    for j, g in enumerate(grammars):
        alone = allocate_token_bitmask(1, backend.vocab_size)
        if g is None:
            assert bool((together[j] == -1).all())
            continue
        g.fill_bitmask(alone, 0)
        assert bool((together[j] == alone[0]).all()), j


@pytest.mark.parametrize("backend_name", ["llguidance", "outlines"])
@pytest.mark.parametrize(
    "key",
    [
        {"regex": r"\d{3}"},
        {"regex": r"[\w\s]{2}"},
        {"json_schema": json.dumps({"type": "string", "pattern": "^\\d+\\s\\w+$"})},
    ],
    ids=["regex-d", "regex-class", "schema-pattern"],
)
def test_shorthand_classes_admit_ascii_only(smollm_tokenizer, backend_name, key):
    """`\\d`, `\\w` and `\\s` are ASCII in every constraint (ECMA-262's `\\d` and `\\w`; ASCII
    whitespace): no allowed token spells a non-ASCII digit, letter or space, as Rust's Unicode
    classes would allow (`١`, `৪`, U+2000)."""
    from plait.runtime.constrained import create_grammar_backend

    compiled = create_grammar_backend(backend_name, smollm_tokenizer).compile(
        make_grammar_key(**key)
    )
    grammar = compiled.new_grammar()
    if "json_schema" in key:
        grammar.advance(smollm_tokenizer.encode('"', add_special_tokens=False)[0])
    bitmask = allocate_token_bitmask(1, smollm_tokenizer.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    words = bitmask.numpy()
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: smollm_tokenizer.vocab_size]
    spelled = smollm_tokenizer.vocab_bytes()
    allowed = [spelled[i] for i in np.flatnonzero(bits)]
    assert allowed
    assert all(max(b) < 0x80 for b in allowed if b), [b for b in allowed if b and max(b) >= 0x80][
        :5
    ]


def test_unicode_classes_stay_available_by_name(smollm_tokenizer, backend):
    compiled = backend.compile(make_grammar_key(regex=r"\p{Nd}"))
    arabic_one = smollm_tokenizer.encode("١", add_special_tokens=False)
    assert compiled.new_grammar().accepts_after(arabic_one)
    assert (
        not backend.compile(make_grammar_key(regex=r"\d")).new_grammar().accepts_after(arabic_one)
    )
