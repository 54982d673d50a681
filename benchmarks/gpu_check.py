"""The GPU device check: one command, under 8 minutes on one GPU. Run it as
`benchmarks/gpu_check.sh` (or `python -m plait.benchmarks.gpu_check --out FILE.json`).

1. tests: every kernel test marked `gpu` (full sizes, CUDA) in a pytest subprocess;
2. kernels: each Triton kernel timed against its torch reference (and flash-attn for prefill);
3. bandwidth: paged decode attention at 32k-token contexts as a fraction of the measured
   device-to-device copy bandwidth (bytes moved per second: a copy reads and writes each byte,
   decode attention reads K and V once);
4. end to end: decode throughput on the default model and a random-weight 1B-class Llama, with
   CUDA graphs on and off (see `ENGINE_GRAPH_KWARG`), and greedy outputs with the Triton kernels
   on against the torch references (`PLAIT_DISABLE_TRITON=1`).

Every section records its error and the check moves on; sections past the time budget are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait.benchmarks.common import print_table, write_json
from plait.benchmarks.gpu_check_e2e import e2e_rows, greedy_agreement
from plait.benchmarks.gpu_check_kernels import (
    DRY,
    Sizes,
    copy_bandwidth,
    decode_bandwidth_rows,
    extend_rows,
    small_kernel_rows,
)

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = [
    "tests/unit/test_kernels_attention.py",
    "tests/unit/test_kernels_norm_rope.py",
    "tests/unit/test_kernels_sampling.py",
    "tests/unit/test_constraint_mask.py",
]


# 1. kernel tests --------------------------------------------------------------------------------


def run_kernel_tests(timeout_s: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        *KERNEL_TESTS,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else "",
        "failures": failures[:30],
        "seconds": round(time.perf_counter() - start, 1),
    }


# driver ------------------------------------------------------------------------------------------


def print_rows(rows: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    print_table(keys, [[r.get(k) for k in keys] for r in rows])


def save_partial(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({**report, "partial": True}, f, indent=2, default=str)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/gpu_check.json")
    parser.add_argument(
        "--budget-s", type=float, default=360.0, help="skip sections started after this"
    )
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes on the CPU: checks this script only"
    )
    args = parser.parse_args(argv)
    sz = DRY if args.dry_run else Sizes()
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device; the CPU interpreter tests are the evidence (try --dry-run)"
        )
        return 2
    t0 = time.perf_counter()
    device_name = torch.cuda.get_device_name() if sz.device == "cuda" else "cpu (dry run)"
    report: dict[str, Any] = {"device": device_name, "torch": torch.__version__, "sections": {}}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None

    def section(name: str, fn: Callable[[], Any]) -> Any:
        if time.perf_counter() - t0 > args.budget_s:
            report["sections"][name] = {"skipped": "time budget"}
            print(f"\n== {name}: skipped (time budget)")
            return None
        print(f"\n== {name}", flush=True)
        start = time.perf_counter()
        try:
            result = fn()
        except Exception:  # noqa: BLE001 - the check reports and goes on
            result = {"error": traceback.format_exc(limit=6)}
            print(result["error"])
        report["sections"][name] = {
            "seconds": round(time.perf_counter() - start, 1),
            "result": result,
        }
        if isinstance(result, list) and result:
            print_rows(result)
        save_partial(args.out, report)  # a run killed by the time limit still leaves its results
        return result

    if not args.skip_tests and not args.dry_run:
        tests = section("kernel tests (-m gpu)", lambda: run_kernel_tests(timeout_s=180))
        if tests and "summary" in tests:
            print(tests["summary"], *tests["failures"], sep="\n")
    bw = section("copy bandwidth", lambda: {"bytes_per_s": copy_bandwidth(sz)})
    if bw and "bytes_per_s" in bw:
        print(f"device-to-device copy: {bw['bytes_per_s'] / 1e9:.0f} GB/s (read + write)")
        section(
            "decode attention bandwidth, 32k contexts",
            lambda: decode_bandwidth_rows(sz, bw["bytes_per_s"]),
        )
    section("extend attention", lambda: extend_rows(sz))
    section("other kernels", lambda: small_kernel_rows(sz))
    if not args.skip_e2e:
        with tempfile.TemporaryDirectory() as tmp:
            section("end to end decode", lambda: e2e_rows(sz, Path(tmp)))
        agreement = section("greedy: triton vs reference", lambda: greedy_agreement(sz))
        if agreement and "identical" in agreement:
            print(
                f"identical greedy outputs: {agreement['identical']}/{agreement['prompts']}; "
                f"common prefixes {agreement['common_prefix_tokens']}"
            )
    report["total_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"\ntotal {report['total_seconds']} s")
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
