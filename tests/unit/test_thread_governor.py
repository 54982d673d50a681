"""The thread governor runs small steps on every CPU thread or on one, whichever computed more
tokens per second lately, and leaves prefill-sized steps on every thread."""

from __future__ import annotations

from plait.runtime.governor import EXPLORE_EVERY, ThreadGovernor


def drive(gov: ThreadGovernor, tokens: int, steps: int, seconds: dict[int, float]) -> list[int]:
    chosen = []
    for _ in range(steps):
        threads = gov.choose(tokens)
        chosen.append(threads)
        gov.record(tokens, threads, seconds[threads])
    return chosen


def test_idle_machine_keeps_every_thread():
    gov = ThreadGovernor(4)
    chosen = drive(gov, 1, 3 * EXPLORE_EVERY, {4: 0.005, 1: 0.012})
    assert chosen[:3] == [4, 4, 1]  # a warm-up step, then both measured
    assert chosen.count(1) <= 2 + 3 * 2  # then one thread only while re-measuring


def test_contended_machine_falls_back_to_one_thread_and_recovers():
    gov = ThreadGovernor(2)
    busy = drive(gov, 1, 3 * EXPLORE_EVERY, {2: 0.060, 1: 0.009})
    assert busy[-EXPLORE_EVERY:].count(1) >= EXPLORE_EVERY - 2
    # the other processes finish: re-measuring every thread notices within a few rounds
    idle = drive(gov, 1, 10 * EXPLORE_EVERY, {2: 0.005, 1: 0.009})
    assert idle[-EXPLORE_EVERY:].count(2) >= EXPLORE_EVERY - 2


def test_prefill_steps_always_use_every_thread():
    gov = ThreadGovernor(2)
    assert drive(gov, ThreadGovernor.MAX_TOKENS, 50, {2: 1.0, 1: 0.1}) == [2] * 50
    assert gov.snapshot() == {}


def test_a_slow_first_step_is_a_warm_up_not_a_verdict():
    """The first step of a size pays one-time costs on the threads it runs with (every thread):
    it is not measured, so one slow start does not put decode on one thread."""
    gov = ThreadGovernor(2)
    first = [True]
    chosen = []
    for _ in range(EXPLORE_EVERY):
        threads = gov.choose(1)
        chosen.append(threads)
        slow_start = first.pop() if first else False
        gov.record(1, threads, 0.050 if slow_start else {2: 0.005, 1: 0.009}[threads])
    assert chosen[:3] == [2, 2, 1]
    assert chosen[3:].count(1) <= 2
