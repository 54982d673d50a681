"""Compile limits of constraints, fuzzed: any regex or schema either passes the static checks or
is rejected with a `GrammarError`, whatever its shape; nothing else escapes, and what passes is
within the size the compilers are bounded for."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.runtime.constrained import GrammarError, make_grammar_key
from plait.runtime.constrained.limits import DEFAULT_LIMITS, check_regex, regex_cost
from tests.reliability.strategies import regexes, schemas


def checked(fn, *args, **kwargs) -> bool:
    """True when accepted, False when rejected with a GrammarError; anything else fails."""
    try:
        fn(*args, **kwargs)
        return True
    except GrammarError as e:
        assert str(e).split(":")[0] in ("regex", "json_schema", "constraint"), e
        return False


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(regexes())
def test_any_regex_is_checked_and_what_passes_is_bounded(regex):
    if checked(check_regex, regex):
        cost = regex_cost(regex)  # None: Python cannot parse it, the compiler will say why
        assert cost is None or cost <= DEFAULT_LIMITS.max_cost, (regex, cost)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(alphabet="()[]{}*+?|\\^$.,0123456789ab-", max_size=200))
def test_garbage_regexes_never_escape(regex):
    checked(make_grammar_key, regex=regex)


@settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(schemas())
def test_any_schema_is_checked(schema):
    checked(make_grammar_key, json_schema=json.dumps(schema))


@pytest.mark.parametrize("depth", [10, 70, 2000, 50_000])
def test_deep_schemas_are_rejected_not_crashed(depth):
    text = '{"type":"object","properties":{"a":' * depth + "{}" + "}}" * depth
    ok = checked(make_grammar_key, json_schema=text)
    assert ok == (2 * depth + 1 <= 2 * DEFAULT_LIMITS.max_nesting)


@pytest.mark.parametrize(
    ("regex", "ok"),
    [
        (r"[0-9]{4}-[0-9]{2}", True),
        (r"(a*)*b", True),
        (r"[ab]*a[ab]{8}", True),
        (r"[a-z]{0,1000}", True),
        (r"[ab]*a[ab]{12}", False),
        (r".*a.{10}", False),
        (r".{0,500}", False),
        (r"a{1,100000}", False),
        ("(" * 33 + ")" * 33, False),
    ],
)
def test_limits_on_known_shapes(regex, ok):
    assert checked(check_regex, regex) is ok


def test_compile_timeout_is_a_grammar_error(tiny_engine, monkeypatch):
    backend = tiny_engine._grammar_cache().backend
    real = backend.compile

    release = threading.Event()

    def stuck(key):  # a compile that cannot finish before the request gives up on it
        release.wait(timeout=30)
        return real(key)

    monkeypatch.setattr(backend, "compile", stuck)
    monkeypatch.setattr(
        tiny_engine, "config", _with(tiny_engine.config, grammar_compile_timeout=0.2)
    )
    try:
        with pytest.raises(GrammarError, match="regex: compiling the constraint took longer"):
            tiny_engine.generate(
                text="x", sampling_params={"regex": "[0-9]{7}", "max_new_tokens": 2}
            )
    finally:
        release.set()


def _with(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


@pytest.fixture(scope="module")
def sandboxed(smollm_tokenizer):
    from plait.runtime.constrained import create_grammar_backend

    backend = create_grammar_backend(
        "outlines", smollm_tokenizer, compile_timeout=1.5, compile_memory_mb=900
    )
    yield backend
    backend.close()


def test_sandbox_stops_what_the_static_limits_miss(sandboxed):
    from plait.runtime.constrained import GrammarKey

    assert sandboxed.sandbox is not None
    ok = sandboxed.compile(GrammarKey("regex", "[0-9]{3}"))
    assert ok.new_grammar() is not None
    with pytest.raises(
        GrammarError, match="regex: compiling the constraint took longer than 1.5 s"
    ):
        sandboxed.compile(GrammarKey("regex", "[^x]{1,300}\\w+"))
    with pytest.raises(GrammarError, match="regex: .*(MB|longer|the limit is)"):
        sandboxed.compile(GrammarKey("regex", ".{0,400}"))
    with pytest.raises(GrammarError, match="invalid pattern"):
        sandboxed.compile(GrammarKey("regex", "(unclosed"))
    assert sandboxed.compile(GrammarKey("regex", "yes|no")).new_grammar() is not None  # restarted
