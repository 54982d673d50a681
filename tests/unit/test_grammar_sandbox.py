"""Which outlines compiles run in the sandbox child: every JSON schema (nested objects multiply
automaton states that the static cost model counts once), and regexes above the static cost;
small regexes stay in process."""

from __future__ import annotations

import pytest

pytest.importorskip("outlines_core")


@pytest.fixture(scope="module")
def sandboxed(smollm_tokenizer):
    from plait.runtime.constrained import create_grammar_backend

    backend = create_grammar_backend(
        "outlines", smollm_tokenizer, compile_timeout=5.0, compile_memory_mb=900
    )
    yield backend
    backend.close()


def test_json_schemas_always_compile_in_the_child(sandboxed, monkeypatch):
    from plait.runtime.constrained import make_grammar_key

    assert sandboxed.sandbox is not None
    built: list[str] = []
    build, build_key = sandboxed.sandbox.build, sandboxed.sandbox.build_key
    monkeypatch.setattr(
        sandboxed.sandbox, "build", lambda regex, name: built.append(name) or build(regex, name)
    )
    monkeypatch.setattr(
        sandboxed.sandbox,
        "build_key",
        lambda key, sentinel: built.append(key.kind) or build_key(key, sentinel),
    )
    small = make_grammar_key(
        json_schema={"type": "object", "properties": {"a": {"type": "boolean"}}}
    )
    grammar = sandboxed.compile(small).new_grammar()
    assert built == ["json_schema"]
    assert grammar is not None
    sandboxed.compile(make_grammar_key(regex="yes|no"))
    assert built == ["json_schema"]  # a small regex skips the round trip


def test_schema_errors_from_the_child_keep_their_class(sandboxed):
    from plait.runtime.constrained import GrammarError, UnsupportedSchemaError, make_grammar_key

    with pytest.raises(UnsupportedSchemaError, match="'if' is not supported"):
        sandboxed.compile(
            make_grammar_key(json_schema={"if": {"type": "string"}, "then": {"maxLength": 2}})
        )
    with pytest.raises(GrammarError, match="json_schema: the repetition .* exceeds the limit"):
        sandboxed.compile(make_grammar_key(json_schema={"type": "string", "maxLength": 100_000}))
    ok = sandboxed.compile(make_grammar_key(json_schema={"type": "integer"}))
    assert ok.new_grammar() is not None  # the child still answers
