"""Scheduling code holds no tensors: the scheduler and the batch types it builds import neither
torch nor the model runner."""

from __future__ import annotations

import subprocess
import sys


def test_the_scheduler_imports_without_torch_or_the_runner():
    code = (
        "import sys, plait.runtime.scheduler, plait.runtime.batch; "
        "print(sorted(m for m in ('torch', 'plait.runtime.model_runner') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
