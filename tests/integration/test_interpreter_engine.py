"""Programs end to end on a tiny random-weight engine through `Runtime(engine=...)`."""

from __future__ import annotations

import re
import time

import pytest
from pydantic import BaseModel, Field

from plait.interpreter import MockCall, ProgramState
from plait.interpreter.backends.local import Runtime
from plait.interpreter.scoring import choice_entries
from plait.lang import assistant, gen, gen_int, program, select, system, user


class RecordingRuntime(Runtime):
    """A Runtime that also keeps every request it sends, like MockBackend.calls."""

    def __init__(self, engine) -> None:
        super().__init__(engine=engine)
        self.calls: list[MockCall] = []

    def generate(self, text, sampling_params, **kwargs):
        self.calls.append(
            MockCall(
                text,
                sampling_params,
                kwargs.get("return_logprob", False),
                kwargs.get("logprob_start_len", -1),
                kwargs.get("rid"),
            )
        )
        return super().generate(text, sampling_params, **kwargs)


@pytest.fixture
def runtime(tiny_engine) -> RecordingRuntime:
    return RecordingRuntime(tiny_engine)


@program
def chat(s, question):
    s += system("You are terse.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=8, temperature=0))


def test_gen_renders_roles_through_the_models_template(runtime, tiny_engine):
    state = chat.run(question="Hello?", backend=runtime)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    tok = tiny_engine.tokenizer
    assert state.text() == tok.apply_chat_template(messages, add_generation_prompt=False)
    (call,) = runtime.calls
    assert call.text == tok.apply_chat_template(messages[:2], add_generation_prompt=True)
    meta = state.get_meta_info("answer")
    assert 0 < meta["completion_tokens"] <= 8 and meta["finish_reason"]["type"] in (
        "stop",
        "length",
    )
    assert messages[-1]["content"] == state["answer"]


def test_greedy_gen_is_deterministic(runtime):
    a = chat.run(question="Hi", backend=runtime)
    b = chat.run(question="Hi", backend=runtime)
    assert a["answer"] == b["answer"]


def test_select_matches_an_independent_scoring(runtime, tiny_engine):
    choices = [" red", " green", " blue sky"]

    @program
    def colour(s):
        s += "My favourite colour is"
        s += select("c", choices)

    state = colour.run(backend=runtime)
    meta = state.get_meta_info("c")
    assert len([c for c in runtime.calls if c.return_logprob]) == 1  # one batched scoring call
    expected = []
    for choice in choices:  # score each choice alone, with logprobs for the whole prompt
        out = tiny_engine.generate(
            "My favourite colour is" + choice,
            {"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=0,
            return_text_in_logprobs=True,
        )
        lps = [e[0] for e in choice_entries(out["meta_info"]["input_token_logprobs"], choice)]
        expected.append(sum(lps) / len(lps))
    assert meta["normalized_prompt_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert state["c"] == choices[max(range(3), key=lambda i: expected[i])]
    assert state.text() == "My favourite colour is" + state["c"]


def test_fork_branches_share_the_prefix(runtime):
    @program
    def branches(s):
        s += user("Name a fruit.")
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += assistant(f"Option {i}:" + gen("fruit", max_tokens=4, temperature=0))
        forks.join()

    state = branches.run(backend=runtime)
    prefix = "<|im_start|>user\nName a fruit.<|im_end|>\n"
    warm, *generating = runtime.calls
    assert warm.is_prefill_only and warm.text == prefix
    assert len(generating) == 3 and all(
        c.text.startswith(prefix + "<|im_start|>assistant\nOption ") for c in generating
    )
    metas = state.get_meta_info("fruit")
    assert len(state["fruit"]) == 3 and all(m["prompt_tokens"] > 0 for m in metas)


def test_fork_branches_report_cached_prefix_tokens(runtime):
    @program
    def branches(s):
        s += user("Name a fruit, please, a nice long prompt so the prefix spans pages.")
        forks = s.fork(2)
        forks += assistant(gen("fruit", max_tokens=2))
        forks.join()

    state = branches.run(backend=runtime)
    assert all(m["cached_tokens"] > 8 for m in state.get_meta_info("fruit"))


def test_stream_and_batch(runtime):
    state = chat.run(question="Stream?", backend=runtime, stream=True)
    assert isinstance(state, ProgramState)
    assert "".join(state.text_iter()) == state.text()
    runtime.calls.clear()
    states = chat.run_batch([{"question": q} for q in ("a", "b", "c")], backend=runtime)
    assert [s.messages()[1]["content"] for s in states] == ["a", "b", "c"]
    precache, *rest = runtime.calls
    assert precache.is_prefill_only and precache.text.endswith("You are terse.<|im_end|>\n")
    assert len(rest) == 3


def test_failing_program_aborts_its_running_request(runtime, tiny_engine):
    @program
    def long_then_fail(s):
        s += "Count forever:" + gen("x", max_tokens=3000, ignore_eos=True)
        time.sleep(0.3)
        raise KeyboardInterrupt  # what a user's Ctrl-C looks like

    with pytest.raises(KeyboardInterrupt):
        long_then_fail.run(backend=runtime)
    deadline = time.monotonic() + 5
    while tiny_engine.stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiny_engine.stats()["num_running"] == 0


class Pet(BaseModel):
    name: str = Field(max_length=8)  # a random-weight model would otherwise ramble to max_tokens
    legs: int = Field(ge=0, le=99)


def test_typed_gens_parse_under_constraints(runtime):
    @program
    def typed(s):
        s += user("Describe a pet as JSON.")
        s += assistant(gen("pet", json_schema=Pet, max_tokens=48, temperature=0))
        s += user("How many legs?")
        s += assistant(gen_int("legs", max_tokens=8, temperature=0))
        s += user("Yes or no?")
        s += assistant(gen("ok", choices=["yes", "no"]))

    state = typed.run(backend=runtime)
    assert isinstance(state["pet"], Pet) and isinstance(state["legs"], int)
    assert state["ok"] in ("yes", "no")


@program
def nested(s):
    s += "Nest: " + gen(
        "nest", grammar='root ::= "(" root ")" | "x"', max_tokens=32, temperature=1.0, seed=5
    )


def test_gen_with_a_grammar(runtime):
    import re

    text = nested.run(backend=runtime)["nest"]
    m = re.fullmatch(r"(\(*)x(\)*)", text)
    assert m and len(m.group(1)) == len(m.group(2)), text
    assert runtime.calls[-1].sampling_params["ebnf"].startswith("root ::=")
    with pytest.raises(ValueError, match="at most one of regex, json_schema, dtype, grammar"):
        gen("x", regex="a", grammar="start: 'a'")


@program
def spaced_record(s, spacing):
    s += "Record: " + gen(
        "record", json_schema=SPACED_RECORD, max_tokens=48, temperature=0, json_whitespace=spacing
    )


SPACED_RECORD = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


def test_gen_takes_the_json_spacing(tiny_engine):
    runtime = Runtime(engine=tiny_engine)
    spaced = spaced_record.run(spacing="conventional", backend=runtime)
    compact = spaced_record.run(spacing="compact", backend=runtime)
    assert re.fullmatch(
        r'\{"n": -?\d+, "ok": (true|false)\}', spaced.text().split("Record: ", 1)[1]
    )
    assert re.fullmatch(r'\{"n":-?\d+,"ok":(true|false)\}', compact.text().split("Record: ", 1)[1])
    assert isinstance(spaced["record"], dict) and isinstance(compact["record"], dict)
