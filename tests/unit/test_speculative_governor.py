"""The speculation governor runs whichever mode delivered more tokens per second at this batch
size, keeps re-measuring the other, and follows a change of workload."""

from __future__ import annotations

from plait.runtime.speculative.governor import EXPLORE_EVERY, SpeculationGovernor


def drive(gov: SpeculationGovernor, batch: int, steps: int, spec_rate: float, plain_rate: float) -> int:
    """Runs `steps` steps where speculating yields `spec_rate` tokens/s; returns how many speculated."""
    count = 0
    for _ in range(steps):
        spec = gov.speculate(batch)
        count += spec
        gov.record(batch, spec, int(100 * (spec_rate if spec else plain_rate)), 100.0)
    return count


def test_measures_both_then_keeps_the_faster_mode_per_bucket():
    gov = SpeculationGovernor()
    assert gov.speculate(1) is True  # speculation is measured first
    gov.record(1, True, 45, 1.0)
    assert gov.speculate(1) is False  # then the plain step
    gov.record(1, False, 25, 1.0)
    spec_steps = drive(gov, 1, 2 * EXPLORE_EVERY, spec_rate=45, plain_rate=25)
    assert spec_steps >= 2 * EXPLORE_EVERY - 6  # speculates, bar a few exploration steps
    # batch 8 is its own bucket, where verification costs more than it wins
    drive(gov, 8, 2, spec_rate=116, plain_rate=137)
    assert drive(gov, 8, 2 * EXPLORE_EVERY, spec_rate=116, plain_rate=137) <= 6
    assert gov.bucket(8) == gov.bucket(15) != gov.bucket(16)


def test_follows_a_change_of_workload():
    gov = SpeculationGovernor()
    drive(gov, 1, EXPLORE_EVERY, spec_rate=45, plain_rate=25)  # extractive: drafts pay
    # open-ended chat on the same engine: the spec rate falls below plain
    later = drive(gov, 1, 3 * EXPLORE_EVERY, spec_rate=20, plain_rate=25)
    assert later < EXPLORE_EVERY // 2
    assert gov.snapshot()[1][0] < gov.snapshot()[1][1]
