"""The calling thread's OpenMP team is released on request (`kernels/openmp.py`): its workers
exit, so libgomp no longer counts them against the CPUs (and throttles the engine's teams)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plait.kernels import native

pytestmark = pytest.mark.skipif(
    native.load("cpu_kernels") is None, reason="native kernels unavailable"
)

# in a fresh interpreter: no team before the parallel op
SCRIPT = """
import os, torch
from plait.kernels import openmp
def threads():
    return len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
openmp.release_thread_team()
before = threads()
torch.ones(1 << 22).add_(1)  # a parallel op: this thread's team (one worker) stays behind
with_team = threads()
released = openmp.release_thread_team()
print(before, with_team, threads(), released)
"""


def test_a_threads_team_is_released():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    )
    before, with_team, after, released = out.stdout.split()
    assert int(with_team) == int(before) + 1, "the parallel op left a worker behind"
    assert released == "True" and int(after) == int(before)
