"""Every ```python block of docs/language.md runs, in order, on the mock backend."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import plait
from plait.interpreter import MockBackend
from plait.lang import set_default_backend

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_language_doc_examples_run(monkeypatch):
    from plait.interpreter.backends import local

    backend = MockBackend(lambda prompt, params: "Paris.")
    monkeypatch.setattr(local, "Runtime", lambda *args, **kwargs: backend)
    blocks = python_blocks(ROOT / "docs" / "language.md")
    assert len(blocks) >= 8
    namespace: dict = {}
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"docs/language.md (python block {i + 1})", "exec"), namespace)
    finally:
        set_default_backend(None)
    assert namespace["state"] is not None and backend.calls


@pytest.mark.parametrize(
    "name", ["program", "gen", "select", "user", "Runtime", "Endpoint", "MockBackend"]
)
def test_public_names_are_exported(name):
    assert getattr(plait, name) is not None
