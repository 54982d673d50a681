"""Helpers shared by the benchmarks: timing, tables, JSON output."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of `repeats` timed runs, in seconds (the least disturbed by a noisy machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


def cpu_model() -> str:
    """The processor's name (Linux's /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(path: str, payload: dict[str, Any]) -> None:
    import torch

    from plait.kernels.quant_matmul import bf16_gemm_enabled, cpu_kind, native_isa

    payload = {
        "command": command_line(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "memory_gib": memory_gib(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "native_isa": native_isa(),
            "bf16_prefill_gemm": bf16_gemm_enabled(),
            "cpu_kind": cpu_kind(),
        },
        **payload,
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"\nwrote {path}")


def command_line() -> str | None:
    """The `plait bench …` command this process runs, as typed (None outside the CLI)."""
    args = sys.argv[1:]
    return "plait " + shlex.join(args) if args[:1] == ["bench"] else None


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def check_decoded(last: dict, decode_len: int) -> None:
    """Raises unless a timed decode run produced all `decode_len` tokens: a step that raised ends
    its requests early, and the time of a cut-short run means nothing."""
    meta = last["meta_info"]
    if meta["completion_tokens"] != decode_len:
        raise RuntimeError(
            f"decode run ended after {meta['completion_tokens']} of {decode_len} tokens: "
            f"{meta['finish_reason']}"
        )
