"""How fast given CPU tensors can be read where they lie (`csrc/cpu_memory.cpp`): a plain streaming
read, split over the threads as the decode kernels split their rows. Benchmarks use it on the
weights one decode step reads, so that their roofline's bandwidth is that of those very bytes."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import torch

from plait.kernels import native


def read_seconds(
    tensors: Sequence[torch.Tensor], repeats: int = 5, num_threads: int | None = None
) -> float | None:
    """The best time of `repeats` passes reading every byte of `tensors` (contiguous, on the CPU),
    or None without the native kernels."""
    fn = native.function(
        "cpu_kernels",
        "plait_read_buffers",
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int],
        ctypes.c_uint64,
    )
    if fn is None:
        return None
    for i, t in enumerate(tensors):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"tensors[{i}]: a contiguous CPU tensor is required")
    n = len(tensors)
    ptrs = (ctypes.c_void_p * n)(*(t.data_ptr() for t in tensors))
    sizes = (ctypes.c_int64 * n)(*(t.nbytes for t in tensors))
    threads = num_threads or torch.get_num_threads()
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass only warms up
        start = time.perf_counter()
        fn(ptrs, sizes, n, threads)
        best = min(best, time.perf_counter() - start)
    return best
