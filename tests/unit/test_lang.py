"""The language layer: primitives build the right immutable nodes; nothing executes."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Literal

import pytest
from pydantic import BaseModel

from plait.lang import (
    DTYPE_REGEX,
    Concat,
    Constraint,
    Gen,
    Role,
    RoleBegin,
    RoleEnd,
    SamplingSpec,
    Select,
    Text,
    ToolSpec,
    assistant,
    describe_tools,
    gen,
    gen_int,
    gen_string,
    program,
    select,
    system,
    user,
)
from plait.lang.tools import tool_call_schema


class Person(BaseModel):
    name: str
    age: int


def test_gen_records_sampling_and_lowers_names():
    node = gen("x", max_tokens=8, stop="\n", temperature=0, min_tokens=1)
    assert isinstance(node, Gen) and node.name == "x"
    assert node.sampling.stop == ("\n",)
    assert node.sampling.to_native() == {
        "max_new_tokens": 8,
        "min_new_tokens": 1,
        "stop": ["\n"],
        "temperature": 0,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.name = "y"  # type: ignore[misc]


def test_sampling_defaults_fill_only_unset_fields():
    node = SamplingSpec(max_tokens=4)
    merged = node.over(SamplingSpec(max_tokens=100, temperature=0.0))
    assert merged.to_native() == {"max_new_tokens": 4, "temperature": 0.0}
    assert SamplingSpec.from_kwargs({"max_new_tokens": 3}).max_tokens == 3
    with pytest.raises(TypeError, match="unknown sampling argument"):
        SamplingSpec.from_kwargs({"temprature": 1})
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingSpec(max_tokens=-1)


@pytest.mark.parametrize(
    ("dtype", "good", "bad"),
    [
        (int, ["0", "-12", "42"], ["01", "1.5", "x"]),
        (float, ["0", "-3.25"], ["1.", "e5"]),
        (bool, ["True", "False"], ["yes"]),
        (str, ['"hi there"', '"a\\"b"'], ["hi", '"a"b"']),
    ],
)
def test_dtype_regexes(dtype, good, bad):
    for s in good:
        assert re.fullmatch(DTYPE_REGEX[dtype], s), s
    for s in bad:
        assert not re.fullmatch(DTYPE_REGEX[dtype], s), s


def test_dtype_parsing():
    assert gen_int("n").constraint.parse(" 42\n") == 42
    assert gen_string("s").constraint.parse('"a b"') == "a b"
    assert gen("b", dtype=bool).constraint.parse("False") is False
    with pytest.raises(ValueError, match="not a valid int"):
        gen_int("n").constraint.parse("four")


def test_json_schema_forms():
    from_model = gen("p", json_schema=Person).constraint
    assert from_model.model is Person
    assert json.loads(from_model.json_schema)["required"] == ["name", "age"]
    assert from_model.parse('{"name": "Ada", "age": 36}') == Person(name="Ada", age=36)
    from_dict = Constraint.build(json_schema={"type": "object"})
    assert from_dict.to_native() == {"json_schema": '{"type": "object"}'}
    assert from_dict.parse('{"a": 1}') == {"a": 1}
    with pytest.raises(ValueError, match="not valid JSON"):
        Constraint.build(json_schema="{oops")
    with pytest.raises(ValueError, match="not a valid Person"):
        from_model.parse('{"name": "Ada"}')


def test_constraint_exclusivity_and_choices():
    with pytest.raises(ValueError, match="at most one"):
        gen("x", regex="a+", dtype=int)
    node = gen("c", choices=["a", "b"])
    assert node == Select("c", ("a", "b"))
    with pytest.raises(ValueError, match="choices cannot be combined"):
        gen("c", choices=["a"], regex="a")
    with pytest.raises(ValueError, match="duplicates"):
        select("c", ["a", "a"])
    with pytest.raises(ValueError, match="method"):
        select("c", ["a", "b"], method="best")
    with pytest.raises(ValueError, match="list of strings"):
        select("c", "ab")


def test_roles_and_concatenation():
    msg = user("Hi ", gen("x"))
    assert isinstance(msg, Role) and msg.body[0] == Text("Hi ")
    both = "Q: " + gen("a") + "\n"
    assert isinstance(both, Concat) and [type(p) for p in both.parts] == [Text, Gen, Text]
    chain = system("s") + user("u") + assistant(gen("a"))
    assert [type(p).__name__ for p in chain.leaves()] == [
        "RoleBegin",
        "Text",
        "RoleEnd",
        "RoleBegin",
        "Text",
        "RoleEnd",
        "RoleBegin",
        "Gen",
        "RoleEnd",
    ]
    assert chain.writes == ("a",)
    with pytest.raises(ValueError, match="give the message content"):
        user()
    with pytest.raises(TypeError, match="strings and plait nodes"):
        user(42)


def test_trace_finds_the_constant_prefix():
    @program
    def classify(s, text, shots=("a", "b")):
        s += system("Classify.")
        for shot in shots:
            s += user(shot) + assistant("label")
        s += user(text)
        s += assistant(select("label", ["pos", "neg"]))

    trace = classify.trace()
    assert trace.stopped_by == "uses argument 'text'"
    assert trace.prefix[0] == RoleBegin("system") and trace.prefix[-1] == RoleEnd("assistant")
    assert len(trace.prefix) == 3 + 2 * 6
    known = classify.trace(text="great")
    assert known.stopped_by is None
    assert known.prefix[-1] == RoleBegin("assistant")  # stops at the select


def test_trace_stops_on_reads_and_formatting():
    @program
    def reads(s, q):
        s += "Question: "
        s += gen("a")
        s += f"{s['a']} {q}"

    assert reads.trace().prefix == (Text("Question: "),)
    assert "reads variable" in (reads.trace().stopped_by or "")

    @program
    def formats(s, q):
        s += "Fixed. "
        s += f"Q: {q}"

    trace = formats.trace()
    assert trace.prefix == (Text("Fixed. "),) and trace.stopped_by == "uses argument 'q'"


def test_program_arguments_and_calls():
    @program
    def p(s, a, b=2):
        return a + b

    assert p.parameters == ("a", "b")
    assert p.bind((1,), {}) == {"a": 1, "b": 2}
    with pytest.raises(TypeError, match="program p"):
        p.bind((), {"c": 3})
    args, defaults = p._split({"a": 1, "temperature": 0.5, "max_new_tokens": 3})
    assert args == {"a": 1} and defaults.to_native() == {"temperature": 0.5, "max_new_tokens": 3}
    with pytest.raises(TypeError, match="unexpected argument"):
        p._split({"nope": 1})
    with pytest.raises(TypeError, match=r"p\.run"):
        p(1)
    with pytest.raises(TypeError, match="first parameter"):
        program(lambda: None)
    with pytest.raises(RuntimeError, match="no backend"):
        p.run(a=1)


def weather(city: str, unit: Literal["c", "f"] = "c") -> str:
    """Current weather in a city.

    More details nobody reads."""
    return f"sunny in {city} ({unit})"


def test_tool_schema_from_signature():
    spec = ToolSpec.from_function(weather)
    schema = spec.openai_schema()["function"]
    assert schema["name"] == "weather" and schema["description"] == "Current weather in a city."
    params = schema["parameters"]
    assert params["required"] == ["city"]
    assert params["properties"]["unit"]["enum"] == ["c", "f"]
    assert spec.invoke({"city": "Oslo"}) == "sunny in Oslo (c)"
    with pytest.raises(ValueError, match="invalid arguments"):
        spec.invoke({"city": "Oslo", "unit": "k"})
    call = tool_call_schema([spec])
    assert call["properties"]["name"] == {"const": "weather"}
    assert "weather" in describe_tools([weather]) and "<tool_call>" in describe_tools([weather])
    with pytest.raises(ValueError, match="named Python functions"):
        ToolSpec.from_function(lambda city: 0)

    def variadic(*cities: str) -> str:
        return ""

    with pytest.raises(ValueError, match="named parameters"):
        ToolSpec.from_function(variadic)
