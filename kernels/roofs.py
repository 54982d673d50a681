"""The machine's roofs the benchmarks measure against (`csrc/cpu_roofs.cpp`): how fast given CPU
tensors can be read where they lie (a plain streaming read, split over the threads as the decode
kernels split their rows; benchmarks use it on the weights one decode step reads, so that their
roofline's bandwidth is that of those very bytes), and the peak rate of the int8 dot products the
quantized kernels multiply with."""

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


def int8_macs_per_second(seconds: float = 0.2, num_threads: int | None = None) -> float | None:
    """int8 multiply-adds per second of the dot-product instruction the quantized kernels use
    (`vpdpbusd` with AVX-512 VNNI, `maddubs` with AVX2), from registers on every thread: the best
    of three runs of about `seconds`; None without the native kernels. The kernels' two-level
    activations take two of these per weight multiply-add, so half this rate bounds them."""
    fn = native.function(
        "cpu_kernels",
        "plait_int8_dot_peak",
        [ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)],
        ctypes.c_int64,
    )
    if fn is None:
        return None
    threads = num_threads or torch.get_num_threads()
    checksum = ctypes.c_int64()
    iters = 1 << 12
    while True:  # grow the run until it lasts long enough to time
        start = time.perf_counter()
        fn(iters, threads, ctypes.byref(checksum))
        if time.perf_counter() - start >= seconds / 4 or iters >= 1 << 40:
            break
        iters *= 4
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        macs = fn(iters, threads, ctypes.byref(checksum))
        best = max(best, macs / (time.perf_counter() - start))
    return best
