"""The machine's limits the speed benches measure against: its read bandwidth (a probe far larger
than the caches), the time to read the weights one decode step reads where they lie, the decode
roofline those give (steps/s if a step only read its weights), the float32 matmul rate of a
prefill-shaped product, and the multiply-adds a token costs in the model's projections (for the
share of the int8 dot products' peak, `kernels/roofs.py: int8_macs_per_second`, a batch uses).
"""

from __future__ import annotations

from typing import Any

import torch

from plait.benchmarks.common import best_of


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best time to sum a float32 tensor far larger than the
    caches."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    seconds = best_of(lambda: x.sum(), repeats)
    return x.numel() * 4 / seconds


def measure_weights_read(engine: Any, repeats: int = 5) -> float | None:
    """The best time to read the weights one decode step reads, where they lie (a plain streaming
    read on the engine's thread count), or None off the CPU or without the native kernels."""
    from plait.kernels.roofs import read_seconds
    from plait.runtime.engine import off_main_thread
    from plait.runtime.models.quantized import weight_tensors

    tensors = [t.contiguous() for t in weight_tensors(engine.core.model)]
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return off_main_thread(read_seconds, tensors, repeats)


def roofline_steps_s(weights_read_s: float | None, bandwidth: float, weight_bytes: int) -> float:
    """Steps/s if a decode step only read its weights: at the pace those very bytes were read,
    else at the machine's measured bandwidth."""
    return 1.0 / weights_read_s if weights_read_s else bandwidth / weight_bytes


def measure_matmul_flops(repeats: int = 5) -> float:
    """float32 FLOP/s of a prefill-shaped matmul ([512, 576] x [576, 3072])."""
    a, b = torch.randn(512, 576), torch.randn(576, 3072)
    a @ b
    return 2 * 512 * 576 * 3072 / best_of(lambda: a @ b, repeats)


def weight_macs(model: torch.nn.Module) -> int:
    """Multiply-adds one token costs in the model's projections and LM head (each weight once; a
    mixture's experts as many as it holds, so an upper bound there)."""
    from plait.runtime.models.quantized import QuantExpertWeights, QuantLinear

    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.in_features * module.out_features
        elif isinstance(module, QuantExpertWeights):
            total += sum(e.in_features * e.out_features for e in module.experts)
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel()
    return total
