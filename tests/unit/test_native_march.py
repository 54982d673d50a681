"""Both builds of the native kernels. `-march=native` takes the AVX-512 (VNNI) paths on a CPU that
has them, so on such a machine the AVX2 paths, which CPUs without AVX-512 run, would go untested:
this runs the quantized matmul's and attention's tests again on a build for `haswell`
(`PLAIT_NATIVE_MARCH`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.kernels import native
from plait.kernels.quant_matmul import native_isa

ROOT = Path(__file__).resolve().parents[2]


def test_the_build_reports_the_instructions_it_took() -> None:
    isa = native_isa()
    assert isa in ("avx512-vnni", "avx2", "portable", "none")
    if isa == "none":
        return
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    if not os.environ.get(native.MARCH_ENV):
        vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags)
        assert isa == ("avx512-vnni" if vnni else "avx2" if "avx2" in flags else "portable")


@pytest.mark.skipif(
    native_isa() != "avx512-vnni", reason="the default build already takes the AVX2 paths"
)
def test_the_avx2_paths_match_the_reference_on_an_avx512_machine() -> None:
    env = {**os.environ, native.MARCH_ENV: "haswell"}
    isa = subprocess.run(
        [
            sys.executable,
            "-c",
            "from plait.kernels.quant_matmul import native_isa; print(native_isa())",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert isa.stdout.strip() == "avx2", isa.stderr[-2000:]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/unit/test_quant_matmul.py",
            "tests/unit/test_quant_matmul_kquants.py",
            "tests/unit/test_batch_invariant.py",
            "tests/unit/test_kernels_attention_cpu.py",
            "tests/unit/test_kernels_extend_attention_cpu.py",
            "tests/unit/test_kv_cache_dtypes.py",
            "tests/unit/test_sampling_cpu.py",
            "tests/integration/test_native_decode_stack.py",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[
        -1000:
    ]
