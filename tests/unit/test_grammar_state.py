"""Per-request grammar state on the SmolLM2 tokenizer, for each backend: advance / reject, EOS,
rollback, copy, masks (model vocabulary wider than the tokenizer's), registry and compile errors."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.constraint_mask import allocate_token_bitmask
from plait.runtime.constrained import (
    GrammarError,
    InvalidRegexError,
    TokenRejectedError,
    create_grammar_backend,
    make_grammar_key,
)
from tests.unit.grammar_support import allowed_ids, backend_for, backend_named, compile_key

BACKENDS = ["outlines", "llguidance"]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


def grammar_for(tok, backend="outlines", **spec):
    if backend == "outlines":
        return compile_key(tok, make_grammar_key(**spec)).new_grammar()
    return backend_named(tok, backend).compile(make_grammar_key(**spec)).new_grammar()


def test_backend_vocabulary(tok):
    backend = backend_for(tok)
    assert backend.vocab_size == tok.vocab_size == 49152
    assert backend.sentinel is not None  # SmolLM2 has bytes no token uses
    assert (
        backend.sentinel_id in tok.special_token_ids
        and backend.sentinel_id not in tok.eos_token_ids
    )
    assert len(backend.single_byte_tokens) > 200


@pytest.mark.parametrize("backend", BACKENDS)
def test_advance_reject_and_eos(tok, backend):
    grammar = grammar_for(tok, backend, regex="ab(c)?")
    a, b, c, eos = *ids(tok, "a"), *ids(tok, "b"), *ids(tok, "c"), tok.eos_token_id
    assert not grammar.try_advance(b) and list(grammar.token_ids) == []
    with pytest.raises(TokenRejectedError):
        grammar.advance(b)
    grammar.advance(a)
    assert not grammar.accepts_eos() and not grammar.try_advance(eos)
    grammar.advance(b)
    assert grammar.accepts_eos() and not grammar.is_terminated()  # "c" may still follow
    grammar.advance(c)
    assert grammar.is_terminated()
    grammar.advance(eos)
    assert grammar.is_terminated() and not grammar.try_advance(eos) and not grammar.try_advance(a)
    assert list(grammar.token_ids) == [a, b, c, eos]


def test_special_tokens_and_sentinel_are_never_allowed(tok):
    grammar = grammar_for(tok, regex="(.|\\x04)*")
    backend = grammar.compiled.backend
    bitmask = allocate_token_bitmask(1, tok.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    allowed = set(allowed_ids(bitmask[0]).tolist())
    assert backend.sentinel_id not in allowed and not grammar.try_advance(backend.sentinel_id)
    assert not (allowed & (set(tok.special_token_ids) - set(tok.eos_token_ids)))
    assert tok.eos_token_id in allowed  # the empty string matches


@pytest.mark.parametrize("backend", BACKENDS)
def test_optional_suffix_and_alternation_stay_reachable(tok, backend):
    # outlines-core 0.2.14 alone drops both continuations; the sentinel keeps them
    grammar = grammar_for(tok, backend, regex="[0-9]{2}(-[0-9]{2})?")
    for t in ids(tok, "12-34"):
        grammar.advance(t)
    assert grammar.accepts_eos()
    grammar = grammar_for(tok, backend, choices=["Paris", "Paris, France"])
    for t in ids(tok, "Paris, France"):
        grammar.advance(t)
    assert grammar.is_terminated()
    grammar = grammar_for(tok, backend, regex="(a|ab)")
    for t in ids(tok, "ab"):
        grammar.advance(t)
    assert grammar.accepts_eos()


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_and_copy(tok, backend):
    grammar = grammar_for(tok, backend, regex="[a-z]{1,200}")
    letters = ids(tok, "a") * 150
    for t in letters:
        grammar.advance(t)
    twin = grammar.copy()
    grammar.rollback(3)  # inside the guide's history
    assert len(grammar.token_ids) == 147
    grammar.rollback(100)  # beyond it: replayed from the start
    assert len(grammar.token_ids) == 47
    for t in letters[:1] * 153:
        grammar.advance(t)
    assert len(grammar.token_ids) == 200 and not grammar.try_advance(letters[0])
    assert len(twin.token_ids) == 150 and twin.try_advance(letters[0])
    twin.advance(tok.eos_token_id)
    twin.rollback(1)
    assert not twin.is_terminated() and twin.try_advance(letters[0])
    with pytest.raises(ValueError, match="rollback"):
        twin.rollback(1000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replace_tail_is_atomic(tok, backend):
    grammar = grammar_for(tok, backend, regex="abc")
    grammar.advance(ids(tok, "a")[0])
    assert not grammar.replace_tail(1, ids(tok, "x"))
    assert list(grammar.token_ids) == ids(tok, "a")
    assert grammar.replace_tail(1, ids(tok, "ab"))
    assert grammar.try_advance(ids(tok, "c")[0])


@pytest.mark.parametrize("name", BACKENDS)
def test_fill_bitmask_for_a_wider_model_vocabulary(tok, name):
    backend = create_grammar_backend(name, tok, vocab_size=49152 + 100)
    grammar = backend.compile(make_grammar_key(regex="[0-9]+")).new_grammar()
    bitmask = allocate_token_bitmask(3, backend.vocab_size)  # all allowed to start with
    assert bitmask.shape[1] == 1540
    grammar.fill_bitmask(bitmask, 1)
    allowed = allowed_ids(bitmask[1])
    assert {tok.decode([int(t)]) for t in allowed} == {str(d) for d in range(10)}
    assert bool((bitmask[0] == -1).all()) and bool((bitmask[2] == -1).all())
    with pytest.raises(ValueError, match="words per row"):
        grammar.fill_bitmask(torch.zeros(1, 10, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="vocab_size"):
        create_grammar_backend(name, tok, vocab_size=100)


def test_registry(tok):
    assert create_grammar_backend("auto", tok).name == "llguidance"
    assert create_grammar_backend("outlines", tok).name == "outlines"
    with pytest.raises(ValueError, match="unknown 'nope'"):
        create_grammar_backend("nope", tok)


@pytest.mark.parametrize(
    "regex,message",
    [
        ("(", "regex: invalid pattern '\\(': missing \\)"),
        ("a{2,1}", "regex: invalid pattern"),
        ("(?<=a)b", "lookaround"),
        ("a^b", "regex: cannot compile"),
        ("\\x06", "regex: cannot compile '\\\\\\\\x06': The vocabulary provided is incompatible"),
        ("\\x04", "no token of this vocabulary"),  # the sentinel itself
    ],
)
def test_invalid_regexes_are_named(tok, regex, message):
    key = make_grammar_key(regex=regex)
    with pytest.raises(InvalidRegexError, match=message):
        backend_for(tok).compile(key)
    assert issubclass(InvalidRegexError, GrammarError)
