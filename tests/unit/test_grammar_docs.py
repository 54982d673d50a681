"""The example in docs/constrained.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "constrained.md"


def test_constrained_doc_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {"__name__": "constrained_doc"})
    out = capsys.readouterr().out
    assert "population=2102650" in out
    assert '{"city": "Par", "population": 0} True' in out  # the budget-closed example
