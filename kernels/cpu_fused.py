"""Fused decoder-layer elementwise ops on the CPU (`csrc/cpu_fused.cpp`): RMSNorm, residual add +
RMSNorm, rotary embedding in place, SiLU- or GELU-tanh-and-multiply. float32 CPU tensors only;
`usable(x)` says when they apply, and the model keeps its torch code for everything else. Each
equals the model's torch math (tests: `tests/unit/test_cpu_fused.py`)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from plait.kernels import native


@cache
def _lib() -> ctypes.CDLL | None:
    lib = native.load("cpu_kernels")
    if lib is None:
        return None
    p, i64, f32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.plait_rms_norm_f32.argtypes = [p, p, p, i64, i64, f32, c_int]
    lib.plait_add_rms_norm_f32.argtypes = [p, p, p, p, i64, i64, f32, c_int]
    lib.plait_rope_f32.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i64, c_int]
    lib.plait_silu_mul_f32.argtypes = [p, p, i64, i64, c_int]
    lib.plait_gelu_tanh_mul_f32.argtypes = [p, p, i64, i64, c_int]
    return lib


def usable(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not native.native_disabled()
        and _lib() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, d = x.numel() // x.shape[-1], x.shape[-1]
    _lib().plait_rms_norm_f32(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, d, eps, torch.get_num_threads()
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x) * weight, residual + x); `residual` is updated in place."""
    x = x.contiguous()
    assert residual.is_contiguous()
    out = torch.empty_like(x)
    rows, d = x.numel() // x.shape[-1], x.shape[-1]
    _lib().plait_add_rms_norm_f32(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        d,
        eps,
        torch.get_num_threads(),
    )
    return out, residual


def rope_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Rotate-half rotary embedding, in place, on the q and k columns of a fused qkv [T, width]."""
    assert qkv.is_contiguous() and positions.dtype == torch.long and inv_freq.dtype == torch.float32
    tokens, width = qkv.shape
    k = qkv[:, num_heads * head_dim :]
    # held while the kernel reads them (a copy where they were not contiguous)
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    _lib().plait_rope_f32(
        qkv.data_ptr(),
        k.data_ptr(),
        positions.data_ptr(),
        inv_freq.data_ptr(),
        tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        width,
        width,
        torch.get_num_threads(),
    )


def gated_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate_up[:, :I]) * gate_up[:, I:], act being "silu" or "gelu_tanh" (GELU with the tanh
    approximation)."""
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    kernel = {"silu": _lib().plait_silu_mul_f32, "gelu_tanh": _lib().plait_gelu_tanh_mul_f32}
    kernel[activation](gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out
