"""The speculation governor runs whichever mode delivered more tokens per second at this batch
size, keeps re-measuring the other, and follows a change of workload."""

from __future__ import annotations

from plait.runtime.speculative.governor import EXPLORE_EVERY, SpeculationGovernor


def drive(
    gov: SpeculationGovernor, batch: int, steps: int, spec_rate: float, plain_rate: float
) -> int:
    """Runs `steps` steps where speculating yields `spec_rate` tokens/s; returns how many
    speculated."""
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


def test_re_measuring_is_paced_by_decode_steps_not_bursts():
    gov = SpeculationGovernor()
    gov.speculate(1)
    gov.record(1, True, 20, 1.0)  # drafts verified: 20 tokens/s
    gov.speculate(1)
    gov.record(1, False, 16 * 30, 16.0, steps=16)  # a 16-step burst: 30 tokens/s
    tried = []
    for _ in range(EXPLORE_EVERY // 16 + 2):  # bursts win; drafts are tried again within the period
        spec = gov.speculate(1)
        tried.append(spec)
        gov.record(1, spec, 20 if spec else 16 * 30, 1.0 if spec else 16.0, steps=1 if spec else 16)
    assert any(tried)


def test_a_drafter_that_finds_nothing_is_asked_only_while_re_measuring():
    gov = SpeculationGovernor()
    asked = []
    for _ in range(4 * EXPLORE_EVERY):
        asked.append(gov.speculate(1))
        gov.record(1, False, 30, 1.0)  # nothing was drafted: a plain step
    assert all(asked[:EXPLORE_EVERY])  # looks for drafts at first
    assert 0 < sum(asked[EXPLORE_EVERY:]) <= 3 * 2  # then only while re-measuring
