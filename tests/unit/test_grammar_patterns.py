"""Regex building blocks (no tokenizer): escaping, choices, dtypes, numeric ranges, schema
normalisation and the named errors of unsupported or invalid schemas."""

from __future__ import annotations

import json
import re
from decimal import Decimal

import pytest
from pydantic import BaseModel, Field

from plait.runtime.constrained import (
    GrammarError,
    InvalidSchemaError,
    UnsupportedSchemaError,
    grammar_key_to_regex,
    json_schema_to_regex,
    make_grammar_key,
    normalize_json_schema,
)
from plait.runtime.constrained.patterns import (
    FORMAT_REGEXES,
    choices_regex,
    dtype_regex,
    escape,
    integer_range_regex,
    natural_range_regex,
    number_range_regex,
)


@pytest.mark.parametrize(
    "text",
    ["a.b", "(x|y)*", "[1-2]{3}", "$^\\", "tab\there", "new\nline", "é日本", "#&-~ ", "\u2028"],
)
def test_escape_is_literal(text):
    assert re.fullmatch(escape(text), text)
    assert not re.fullmatch(escape(text), text + "x")


def test_choices_regex():
    regex = choices_regex(["a", "ab", "a.b", "a"])
    assert all(re.fullmatch(regex, c) for c in ["a", "ab", "a.b"])
    assert not re.fullmatch(regex, "axb")
    assert regex.index("a\\.b") < regex.index("|a)")  # longest first
    for bad, message in [([], "empty"), ("ab", "list"), ([1], "string")]:
        with pytest.raises(ValueError, match=message):
            choices_regex(bad)


def test_dtype_regexes():
    cases = {
        int: (["0", "-12", "345"], ["01", "+1", "1.0"]),
        float: (["0", "-1.5", "2e10", "3.25E-2"], ["1.", ".5", "--1"]),
        bool: (["True", "False"], ["true", "1"]),
        str: (['""', '"a \\"b\\""'], ["a", '"a']),
    }
    for dtype, (good, bad) in cases.items():
        regex = dtype_regex(dtype)
        assert dtype_regex(dtype.__name__) == regex
        assert all(re.fullmatch(regex, g) for g in good), dtype
        assert not any(re.fullmatch(regex, b) for b in bad), dtype
    with pytest.raises(ValueError, match="dtype: 'list'"):
        dtype_regex(list)


@pytest.mark.parametrize(
    "low,high",
    [(0, 0), (0, 9), (3, 17), (7, 100), (99, 1000), (123, 4567), (0, None), (8, None), (45, None)],
)
def test_natural_range_regex(low, high):
    regex = natural_range_regex(low, high)
    top = (high if high is not None else 100_000) + 30
    for n in range(0, top):
        assert bool(re.fullmatch(regex, str(n))) == (n >= low and (high is None or n <= high)), n
    assert not re.fullmatch(regex, "007")


@pytest.mark.parametrize(
    "low,high", [(-10, 250), (-300, -12), (5, 5), (None, 3), (-2, None), (None, -7), (0, 0)]
)
def test_integer_range_regex(low, high):
    regex = integer_range_regex(low, high)
    for n in range(-1200, 1200):
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert bool(re.fullmatch(regex, str(n))) == inside, n
    assert not re.fullmatch(regex, "-0")


NUMBER_SAMPLES = [
    "0",
    "-0.5",
    "0.5",
    "1",
    "1.0",
    "1.00",
    "1.01",
    "0.99",
    "2",
    "-1",
    "-1.0",
    "-1.5",
    "10",
    "9.999",
    "10.0",
    "10.5",
    "-5",
    "-5.0",
    "-4.99",
    "-5.01",
    "3",
    "3.000",
    "17.25",
    "100",
]


@pytest.mark.parametrize(
    "low,high,low_inclusive,high_inclusive",
    [
        (0, 1, True, True),
        (-5, 10, False, False),
        (-5, 10, True, True),
        (2, None, False, True),
        (None, -1, True, False),
        (-10, -1, True, True),
        (0, 0, True, True),
        (None, None, True, True),
    ],
)
def test_number_range_regex(low, high, low_inclusive, high_inclusive):
    regex = number_range_regex(
        low, high, low_inclusive=low_inclusive, high_inclusive=high_inclusive
    )
    for text in NUMBER_SAMPLES:
        x = Decimal(text)
        above = low is None or (x >= low if low_inclusive else x > low)
        below = high is None or (x <= high if high_inclusive else x < high)
        assert bool(re.fullmatch(regex, text)) == (above and below), (text, regex)


@pytest.mark.parametrize(
    "fmt,good,bad",
    [
        ("date", "2024-02-29", "2024-13-01"),
        ("time", "23:59:59.123+01:00", "24:00:00Z"),
        ("date-time", "2024-02-29T12:00:00Z", "2024-02-29 12:00:00Z"),
        ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567e89b12d3a456426614174000"),
        ("email", "first.last+tag@sub.example.com", "no-at-sign.example.com"),
        ("hostname", "api.example-1.org", "-bad.org"),
        ("ipv4", "255.0.10.1", "256.0.0.1"),
        ("uri", "https://example.com:8080/a/b?q=1", "not a uri"),
    ],
)
def test_format_regexes_are_json_strings(fmt, good, bad):
    regex = FORMAT_REGEXES[fmt]
    assert re.fullmatch(regex, json.dumps(good))
    assert not re.fullmatch(regex, json.dumps(bad))


class Pet(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=30)
    nickname: str | None = None


def test_normalize_dict_string_pydantic():
    as_dict = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    normalized = normalize_json_schema(as_dict)
    assert normalized == json.dumps(as_dict, separators=(",", ":"))  # key order kept
    assert normalize_json_schema(json.dumps(as_dict, indent=2)) == normalized
    assert json.loads(normalize_json_schema(Pet)) == Pet.model_json_schema()
    regex = json_schema_to_regex(normalize_json_schema(Pet))
    assert re.fullmatch(regex, '{"name":"Rex","age":30,"nickname":null}')
    assert not re.fullmatch(regex, '{"name":"Rex","age":31}')


def test_whitespace_pattern():
    schema = normalize_json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    assert re.fullmatch(json_schema_to_regex(schema), '{"a":1}')
    assert not re.fullmatch(json_schema_to_regex(schema), '{"a": 1}')
    assert re.fullmatch(json_schema_to_regex(schema, None), '{ "a": 1 }')
    assert re.fullmatch(json_schema_to_regex(schema, r"[\n ]{0,2}"), '{\n "a":\n1}')


@pytest.mark.parametrize(
    "schema,error,message",
    [
        ("{not json", InvalidSchemaError, "not valid JSON"),
        ([1, 2], InvalidSchemaError, "expected a JSON object"),
        ({"type": "strin"}, InvalidSchemaError, "invalid schema at #/type"),
        (
            {"type": "object", "properties": {"a": {"minimum": "x"}}},
            InvalidSchemaError,
            "#/properties/a/minimum",
        ),
        (
            {"type": "string", "pattern": "(unclosed"},
            InvalidSchemaError,
            "#/pattern: '\\(unclosed' is not a 'regex'",
        ),
        ({"not": {"type": "string"}}, UnsupportedSchemaError, "#: 'not' is not supported"),
        (
            {"type": "object", "properties": {"x": {"type": "integer", "multipleOf": 3}}},
            UnsupportedSchemaError,
            "#/properties/x: 'multipleOf'",
        ),
        (
            {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
            UnsupportedSchemaError,
            "'uniqueItems'",
        ),
        ({"allOf": [{"type": "integer"}, {"minimum": 0}]}, UnsupportedSchemaError, "'allOf'"),
        (
            {"type": "string", "format": "ipv6"},
            UnsupportedSchemaError,
            "format 'ipv6' is not supported",
        ),
        ({"type": "number", "minimum": 0.5}, UnsupportedSchemaError, "non-integer bound 0.5"),
        (
            {"type": "integer", "minimum": 5, "maximum": 4},
            UnsupportedSchemaError,
            "empty integer range",
        ),
        (
            {"type": "object", "properties": {"a": {}}, "required": ["b"]},
            UnsupportedSchemaError,
            "required property 'b'",
        ),
        ({"$ref": "https://example.com/schema.json"}, UnsupportedSchemaError, "external \\$ref"),
        (
            {"$ref": "#/$defs/missing"},
            UnsupportedSchemaError,
            "json_schema: Invalid reference path",
        ),
        (
            {"type": "string", "minLength": 1, "format": "email"},
            UnsupportedSchemaError,
            "together with",
        ),
        (
            {"properties": {"a": {}}, "anyOf": [{"required": ["a"]}]},
            UnsupportedSchemaError,
            "'anyOf' next to 'properties'",
        ),
    ],
)
def test_schema_errors_are_named_by_the_regex_builder(schema, error, message):
    with pytest.raises(error, match=message):
        grammar_key_to_regex(make_grammar_key(json_schema=schema))


def test_make_grammar_key():
    assert make_grammar_key() is None
    assert make_grammar_key(regex="a+").pattern == "a+"
    assert make_grammar_key(choices=["x", "y"]).kind == "regex"
    assert make_grammar_key(dtype="int").pattern == dtype_regex(int)
    key = make_grammar_key(json_schema={"type": "integer"})
    assert key.kind == "json_schema" and key.json_whitespace == "conventional"
    assert make_grammar_key(json_schema='{"type": "integer"}') == key
    with pytest.raises(GrammarError, match="at most one of regex, json_schema"):
        make_grammar_key(regex="a", choices=["a"])
    with pytest.raises(GrammarError, match="regex: expected a string"):
        make_grammar_key(regex=3)
    with pytest.raises(GrammarError, match="choices: the list is empty"):
        make_grammar_key(choices=[])
    assert issubclass(GrammarError, ValueError)


@pytest.mark.parametrize(
    "pattern, expected",
    [
        (r"\d{4}-\d{2}", "[0-9]{4}-[0-9]{2}"),
        (r"[\d\s]+", "[0-9\\t\\n\\x0b\\x0c\\r ]+"),
        (r"\D\W", "[^0-9][^0-9A-Za-z_]"),
        (r"[^\d_]", "[^0-9_]"),
        (r"[a\S]", "[a[^\\t\\n\\x0b\\x0c\\r ]]"),
        (r"\\d", r"\\d"),  # an escaped backslash, then a literal d
        (r"[\]\w]", r"[\]0-9A-Za-z_]"),
        (r"\p{Nd}\.", r"\p{Nd}\."),  # Unicode classes stay available by name
    ],
)
def test_shorthand_classes_are_ascii(pattern, expected):
    from plait.runtime.constrained.patterns import ascii_classes

    assert ascii_classes(pattern) == expected


@pytest.mark.parametrize("pattern", [r"\d{2}", r"[\w\s]+", r"\D\S", r"[^\d]x", r"\w+\s?\d*"])
def test_shorthand_classes_match_as_pythons_ascii_mode(pattern):
    from plait.runtime.constrained.patterns import ascii_classes

    rewritten = ascii_classes(pattern)
    for text in ["12", "a_1", "١٢", "x y", "\u2000x", "ab\t3", "éx", "_ 9"]:
        assert bool(re.fullmatch(pattern, text, re.ASCII)) == bool(re.fullmatch(rewritten, text)), (
            text
        )
