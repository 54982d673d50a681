"""The soak, fuzz and replica-death drivers of `make reliability` at CI size
(`tests/reliability`, QUICK budget): nothing lost, leaked or crashed. Chaos in one server is
covered in CI by test_server_faults.py."""

from __future__ import annotations

from tests.reliability.__main__ import QUICK, run
from tests.reliability.report import table


def test_quick_soak_fuzz_and_replica_death(tiny_llama_dir):
    tallies = run(QUICK, tiny_llama_dir, {"soak", "fuzz", "replicas"}, log=lambda _: None)
    names = ["fuzz-http", "fuzz-bodies", "fuzz-constraints", "chaos-replica-death", "soak"]
    assert [t.name for t in tallies] == names
    assert all(t.ok for t in tallies), table(tallies) + "\n" + repr([t.notes for t in tallies])
    by_name = {t.name: t for t in tallies}
    assert by_name["fuzz-bodies"].fuzz_cases >= 3 * QUICK.body_examples
    assert sum(t.fuzz_cases for t in tallies) > 500
    death = by_name["chaos-replica-death"]
    assert death.extra["in_flight_at_kill"] > 0, death.extra  # the kill landed under load
    assert {
        "noticed_killed_under_load_s",
        "noticed_restarted_s",
        "noticed_killed_while_idle_s",
    } <= set(death.extra)
    soak = by_name["soak"]
    assert soak.sent == soak.completed + soak.refused + soak.timed_out
