"""Interpreter semantics on the mock backend: text, roles, variables, typed results."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from plait.interpreter import MockBackend, OutputParseError, ProgramState, UnsupportedFeatureError
from plait.lang import (
    assistant,
    gen,
    gen_int,
    gen_string,
    program,
    set_default_backend,
    system,
    user,
)


def im(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


@program
def qa(s, question):
    s += system("Be brief.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=16))


def test_text_roles_and_variables():
    backend = MockBackend("Paris.")
    state = qa.run(question="Capital of France?", backend=backend)
    assert isinstance(state, ProgramState)
    assert state["answer"] == "Paris."
    assert state.text() == im("system", "Be brief.") + im("user", "Capital of France?") + im(
        "assistant", "Paris."
    )
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]
    (call,) = backend.calls
    assert (
        call.text
        == im("system", "Be brief.") + im("user", "Capital of France?") + "<|im_start|>assistant\n"
    )
    assert call.sampling_params == {"max_new_tokens": 16}
    assert state.get_meta_info("answer")["completion_tokens"] == 2  # "Paris" "."


def test_role_context_managers_equal_wrappers():
    @program
    def managed(s):
        with s.system():
            s += "Be brief."
        with s.user():
            s += "Capital of France?"
        with s.assistant():
            s += gen("answer", max_tokens=16)

    a = managed.run(backend=MockBackend("Paris."))
    b = qa.run(question="Capital of France?", backend=MockBackend("Paris."))
    assert a.text() == b.text() and a.messages() == b.messages()


def test_plain_text_gen_and_unnamed_gen():
    @program
    def completion(s):
        s += "The sky is "
        s += gen(max_tokens=2)
        s += ". Then " + gen("rest", stop=",") + "!"

    state = completion.run(backend=MockBackend(["blue", "rain, wind"]))
    assert state.text() == "The sky is blue. Then rain!"
    assert state.variables() == {"rest": "rain"}
    assert state.messages() == []
    assert state.get_meta_info("rest")["finish_reason"] == {"type": "stop", "matched": ","}


def test_max_tokens_cuts_output():
    @program
    def short(s):
        s += gen("x", max_tokens=2)

    state = short.run(backend=MockBackend("one two three"))
    assert state["x"] == "one two"
    assert state.get_meta_info("x")["finish_reason"]["type"] == "length"


def test_run_defaults_apply_to_every_gen_and_lose_to_explicit_values():
    @program
    def two(s):
        s += gen("a")
        s += gen("b", temperature=0.7, max_tokens=3)

    backend = MockBackend("x")
    two.run(backend=backend, temperature=0, max_tokens=9)
    assert [c.sampling_params for c in backend.calls] == [
        {"max_new_tokens": 9, "temperature": 0},
        {"max_new_tokens": 3, "temperature": 0.7},
    ]


def test_program_parameter_named_like_a_sampling_field_goes_to_the_program():
    @program
    def warm(s, temperature):
        s += f"It is {temperature} degrees. " + gen("x")

    backend = MockBackend("ok")
    assert warm.run(temperature=30, backend=backend).text() == "It is 30 degrees. ok"
    assert backend.calls[0].sampling_params == {}


class City(BaseModel):
    name: str
    population: int


def test_typed_results():
    @program
    def typed(s):
        s += gen("city", json_schema=City)
        s += gen_int("n")
        s += gen_string("word")
        s += gen("flag", dtype=bool)
        s += gen("raw", json_schema={"type": "object"})
        s += gen("code", regex=r"[A-Z]{3}-\d{2}")

    scripted = [
        '{"name": "Oslo", "population": 700000}',
        "42",
        '"hello"',
        "True",
        '{"k": [1]}',
        "ABC-12",
    ]
    state = typed.run(backend=MockBackend(scripted))
    assert state["city"] == City(name="Oslo", population=700000)
    assert state.var_text("city") == scripted[0]
    assert (state["n"], state["word"], state["flag"], state["raw"], state["code"]) == (
        42,
        "hello",
        True,
        {"k": [1]},
        "ABC-12",
    )
    assert '"population"' in state.text()


def test_mock_honours_constraints_it_was_not_scripted_for():
    @program
    def typed(s):
        s += (
            gen("city", json_schema=City)
            + " "
            + gen_int("n")
            + " "
            + gen("code", regex=r"[A-Z]{3}-\d{2}")
        )

    state = typed.run(backend=MockBackend("free text"))
    assert state["city"] == City(name="x", population=0)
    assert state["n"] == 0 and state["code"] == "AAA-00"


def test_unparseable_typed_output_raises_naming_the_variable():
    @program
    def typed(s):
        s += gen("city", json_schema=City, max_tokens=3)

    with pytest.raises(
        OutputParseError,
        match=r"gen 'city': not a valid City \(.*\) \(the output was cut at max_tokens\)",
    ):
        typed.run(backend=MockBackend('{"name": "Oslo", "population": 5}'))


def test_programs_call_programs():
    @program
    def greet(s, name):
        s += user(f"Hi, I am {name}.")
        s += assistant(gen("reply"))

    @program
    def conversation(s):
        s += system("Be kind.")
        greet(s, "Ada")
        greet(s, name="Bob")

    state = conversation.run(backend=MockBackend(["Hello Ada", "Hello Bob"]))
    assert [m["content"] for m in state.messages()] == [
        "Be kind.",
        "Hi, I am Ada.",
        "Hello Ada",
        "Hi, I am Bob.",
        "Hello Bob",
    ]
    assert state["reply"] == "Hello Bob"


def test_reading_a_variable_waits_for_it_and_the_program_can_branch():
    @program
    def branching(s):
        s += gen("first")
        if s["first"] == "yes":
            s += " then " + gen("second")

    state = branching.run(backend=MockBackend(["yes", "more"]))
    assert state.text() == "yes then more"


def test_missing_variable_and_nested_roles_are_errors():
    @program
    def missing(s):
        s += gen("a")
        return s["b"]

    with pytest.raises(KeyError, match="'b' was never set"):
        missing.run(backend=MockBackend("x"))

    @program
    def nested(s):
        with s.user():
            s += assistant("no")

    with pytest.raises(ValueError, match="cannot nest"):
        nested.run(backend=MockBackend("x"))


def test_unsupported_feature_is_a_named_error():
    @program
    def needs_regex(s):
        s += gen("x", regex="a+")

    backend = MockBackend("a", features={"logprobs"})
    with pytest.raises(UnsupportedFeatureError, match="'mock' does not support regex"):
        needs_regex.run(backend=backend)
    assert backend.calls == []


def test_default_backend():
    backend = MockBackend("Paris.")
    set_default_backend(backend)
    try:
        assert qa.run(question="?")["answer"] == "Paris."
    finally:
        set_default_backend(None)
    with pytest.raises(TypeError, match="not a plait backend"):
        set_default_backend(object())


def test_set_var_and_contains():
    @program
    def p(s):
        s += gen("a")

    state = p.run(backend=MockBackend("x"))
    state.set_var("b", 3)
    assert "b" in state and state["b"] == 3 and "zzz" not in state
