"""Every ```python block in the README and the docs listed runs, in order, on the default model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize(
    "doc",
    [
        "README.md",
        "docs/engine.md",
        "docs/models.md",
        "docs/language.md",
        "docs/constrained.md",
        "docs/speculative.md",
        "docs/cpu.md",
        "docs/scaling.md",
        "docs/reliability.md",
        "docs/kv_tiers.md",
    ],
)
def test_doc_examples_run(doc):
    blocks = python_blocks(ROOT / doc)
    assert blocks, f"{doc} has no python examples"
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{ROOT / doc} (python block {i + 1})", "exec"), namespace)
