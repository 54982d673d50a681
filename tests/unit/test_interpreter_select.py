"""`select`: one batched prefill-only scoring call, three methods, choice appended."""

from __future__ import annotations

import math

import pytest

from plait.interpreter import MockBackend, UnsupportedFeatureError
from plait.interpreter.scoring import choice_entries, greedy_ranks
from plait.lang import gen, program, select


def favour(word: str, penalty: float = -4.0):
    return lambda context, token: 0.0 if word in token else penalty


@program
def pick(s, method="token_length_normalized"):
    s += "The capital of France is"
    s += select("city", [" Paris", " Rome", " Berlin"], method=method)
    s += "."


@pytest.mark.parametrize(
    "method", ["token_length_normalized", "greedy_token", "unconditional_likelihood_normalized"]
)
def test_select_methods_pick_the_likely_choice(method):
    backend = MockBackend(scorer=favour("Rome"))
    state = pick.run(method=method, backend=backend)
    assert state["city"] == " Rome"
    assert state.text() == "The capital of France is Rome."
    meta = state.get_meta_info("city")
    assert meta["method"] == method and meta["choices"] == [" Paris", " Rome", " Berlin"]
    assert max(range(3), key=lambda i: meta["scores"][i]) == 1


def test_select_is_one_batched_prefill_only_call():
    backend = MockBackend(scorer=favour("Rome"))
    pick.run(backend=backend)
    (call,) = backend.calls
    assert call.text == [f"The capital of France is{c}" for c in (" Paris", " Rome", " Berlin")]
    assert call.is_prefill_only and call.return_logprob
    prompt_tokens = 5  # "The" " capital" " of" " France" " is"
    assert call.logprob_start_len == prompt_tokens - 2
    assert len(call.rid) == 3 and len(set(call.rid)) == 3


def test_unconditional_method_adds_one_call_for_the_bare_choices():
    backend = MockBackend(scorer=favour("Rome"))
    pick.run(method="unconditional_likelihood_normalized", backend=backend)
    assert len(backend.calls) == 2
    assert backend.calls[1].text == [" Paris", " Rome", " Berlin"]


def test_token_length_normalization_scores_only_the_choice_tokens():
    # " New York" has two tokens, each scored -1; " Rome" one token scored -1.5.
    scores = {" New": -1.0, " York": -1.0, " Rome": -1.5}
    backend = MockBackend(scorer=lambda ctx, tok: scores.get(tok, -9.0))

    @program
    def city(s):
        s += "I live in" + select("c", [" Rome", " New York"])

    state = city.run(backend=backend)
    assert state["c"] == " New York"
    meta = state.get_meta_info("c")
    assert meta["normalized_prompt_logprobs"] == [-1.5, -1.0]
    assert [[e[2] for e in es] for es in meta["input_token_logprobs"]] == [
        [" Rome"],
        [" New", " York"],
    ]


def test_gen_with_choices_is_a_select():
    @program
    def p(s):
        s += "Answer:" + gen("a", choices=[" yes", " no"])

    state = p.run(backend=MockBackend(scorer=favour("no")))
    assert state["a"] == " no"


def test_select_needs_logprobs():
    with pytest.raises(UnsupportedFeatureError, match="logprobs"):
        pick.run(backend=MockBackend(features={"stream"}))


def test_choice_entries_handle_a_token_merged_across_the_boundary():
    # prompt "Answer: " + choice "yes" tokenized as ["Answer", ":", " yes"]
    entries = [[None, 1, "Answer"], [-0.1, 2, ":"], [-0.7, 3, " yes"]]
    assert choice_entries(entries, "yes") == [[-0.7, 3, " yes"]]
    assert choice_entries(entries, "s") == [[-0.7, 3, " yes"]]
    # no token texts: everything after the first entry
    assert choice_entries([[None, 1, None], [-0.2, 2, None]], "x") == [[-0.2, 2, None]]


def test_greedy_ranks_break_ties_on_later_tokens():
    assert greedy_ranks([[-1.0, -5.0], [-1.0, -0.5], [-2.0]]) == [0.0, 1.0, 0.0]
    assert greedy_ranks([[-0.5], [-1.0, 0.0]]) == [1.0, 0.0]
    assert not any(math.isnan(x) for x in greedy_ranks([[], [-1.0]]))
