"""The per-step policies' deterministic modes (`runtime/policies.py`) and their configuration."""

from __future__ import annotations

import threading

import pytest
import torch

from plait.runtime.config import EngineConfig
from plait.runtime.policies import SpeculationPolicy, ThreadPolicy


def test_speculation_modes_decide_without_measuring():
    always, never, auto = (
        SpeculationPolicy("always"),
        SpeculationPolicy("never"),
        SpeculationPolicy("auto"),
    )
    for size in (1, 3, 8, 64):
        for _ in range(3):  # the governor would stop drafting once plain steps measured faster
            for policy in (always, never, auto):
                policy.record(size, verified=False, tokens=100.0, seconds=0.01)
                policy.record(size, verified=True, tokens=1.0, seconds=1.0)
        assert always.speculate(size) and not never.speculate(size)
        assert not auto.speculate(size)  # drafts measured 100x slower: auto does not draft


def test_fixed_threads_are_set_on_the_loop_thread_and_not_governed():
    policy = ThreadPolicy(torch.device("cpu"), cpu_threads=1)
    assert policy.governor is None and policy.current == 1
    seen = []

    def loop():
        policy.start()
        seen.append((policy.choose(4), torch.get_num_threads()))
        policy.release()

    t = threading.Thread(target=loop)
    t.start()
    t.join()
    assert seen == [(None, 1)]


def test_auto_threads_are_governed_on_a_multicore_cpu_only():
    threads = torch.get_num_threads()
    auto = ThreadPolicy(torch.device("cpu"), cpu_threads=None)
    assert (auto.governor is not None) == (threads > 1)
    assert ThreadPolicy(torch.device("meta"), cpu_threads=None).governor is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"speculation": "sometimes", "speculative_algorithm": "ngram"}, "speculation"),
        ({"speculation": "always"}, "speculation"),  # nothing to draft with
        ({"cpu_threads": 0}, "cpu_threads"),
        ({"cpu_threads": True}, "cpu_threads"),
        ({"cpu_threads": "2"}, "cpu_threads"),
    ],
)
def test_bad_policy_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig.from_kwargs(**kwargs)


def test_policy_settings_route_to_the_engine_config():
    cfg = EngineConfig.from_kwargs(
        cpu_threads=1, speculation="never", speculative_algorithm="ngram"
    )
    assert (cfg.cpu_threads, cfg.speculation) == (1, "never")
