"""The soak and fuzz drivers of `make reliability` at CI size (`tests/reliability`, QUICK budget):
nothing lost, leaked or crashed. Chaos is covered in CI by test_server_faults.py."""

from __future__ import annotations

from tests.reliability.__main__ import QUICK, run
from tests.reliability.report import table


def test_quick_soak_and_fuzz(tiny_llama_dir):
    tallies = run(QUICK, tiny_llama_dir, {"soak", "fuzz"}, log=lambda _: None)
    assert [t.name for t in tallies] == ["fuzz-http", "fuzz-constraints", "soak"]
    assert all(t.ok for t in tallies), table(tallies) + "\n" + repr([t.notes for t in tallies])
    assert sum(t.fuzz_cases for t in tallies) > 50
    soak = tallies[-1]
    assert soak.sent == soak.completed + soak.refused + soak.timed_out

