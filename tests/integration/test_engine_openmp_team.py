"""An idle engine holds no OpenMP team: its loop releases its thread's workers once nothing is
left to run (`EngineCore._run_loop`), so the engines of one process do not throttle each other's
parallel regions (`kernels/openmp.py`). Counted in a fresh interpreter: the threads outside
Python's own, while a step has just run (from a `StepFinished` subscriber, on the engine's thread)
and once the engine is idle."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plait.kernels import native

pytestmark = pytest.mark.skipif(
    native.load("cpu_kernels") is None, reason="native kernels unavailable"
)

SCRIPT = """
import os, sys, threading, time
import torch
from plait import Engine
from plait.runtime.events import StepFinished

def native_threads():
    return len(os.listdir("/proc/self/task")) - len(threading.enumerate())

torch.set_num_threads(2)
engine = Engine(model_path=sys.argv[1], max_total_tokens=1024, cpu_threads=2)
busy = []
engine.events.subscribe(lambda event: busy.append(native_threads()), StepFinished)
engine.generate("Hello there", {"max_new_tokens": 8, "ignore_eos": True})
deadline = time.monotonic() + 30
while native_threads() >= max(busy) and time.monotonic() < deadline:
    time.sleep(0.02)  # the loop releases the team as it goes idle, after the result went out
print(max(busy), native_threads())
engine.shutdown()
"""


def test_an_idle_engine_releases_its_threads_team(tiny_llama_dir):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_llama_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=180,
    )
    busy, idle = map(int, out.stdout.split())
    assert idle < busy, "the engine's OpenMP workers outlived its steps"
