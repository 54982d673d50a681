"""plait's `kernels/` folder must not stand in for the `kernels` distribution transformers
imports."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess:
    # the repository root first on the path, as pytest and `python -m` from a clone put it
    return subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); {code}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_transformers_model_classes_load_beside_the_kernels_folder():
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the kernels distribution is not installed: nothing to shadow")
    proc = _run(
        "from plait.runtime.thirdparty import import_transformers; t = import_transformers(); "
        "import kernels, transformers.integrations.hub_kernels; "
        "import plait.kernels.dispatch; print(kernels.__file__)"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip()).parent != ROOT / "kernels"


def test_plait_kernels_stays_plait_kernels():
    proc = _run(
        "from plait.runtime.thirdparty import unshadow; unshadow(); "
        "import plait.kernels as k; print(k.__file__)"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip()).parent.name == "kernels"
    assert "site-packages/kernels" not in proc.stdout
