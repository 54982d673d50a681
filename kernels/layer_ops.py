"""The decoder layers' operations besides their matmuls, one object per backend: RMSNorm (with the
residual add), rotary embedding, the gated activation and paged attention.

An engine chooses its object once, from what does not change while it runs
(`runtime/execution.py: choose_execution`, by `choose_layer_ops`), and hands it to the layers in
every step's `ForwardBatch`; a layer calls the object it was given and never asks the device, the
dtype or the environment again.

- `LayerOps`: torch's own operations, on any device and dtype (the reference).
- `NativeCpuOps`: float32 activations on the CPU with the native library built: one native call
  per operation (`cpu_fused`), q and k rotated in place from the positions.
- `TritonOps`: CUDA with Triton: norms and rotary embedding in one pass over memory each
  (`norm_rope`).

Each holds the paged-attention backend chosen beside it (`create_attention`, by the kind
`runtime/execution.py: choose_attention` names): "native" (`attention_cpu.NativeAttention`, rows
over slot tables), "triton" (`attention_triton.TritonAttention`) or "torch"
(`attention.TorchAttention`), each built with the extend kernel and KV store for the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plait.kernels import cpu_fused, native, norm_rope
from plait.kernels.attention import AttentionMetadata, KVScales, TorchAttention
from plait.kernels.attention_cpu import NativeAttention
from plait.kernels.dispatch import use_triton
from plait.kernels.quant_matmul import native_dense_matmul, native_quant_available
from plait.kernels.tuning import CPU_MLP_ROWS

ATTENTION_KINDS = ("native", "triton", "torch")


def create_attention(
    kind: str, device: torch.device, dtype: torch.dtype, head_dim: int
) -> TorchAttention:
    """The attention backend `kind` names, for activations of `dtype` on `device` with heads of
    `head_dim` (Triton's module is imported only where it is chosen)."""
    if kind == "native":
        return NativeAttention(device, dtype, head_dim)
    if kind == "triton":
        from plait.kernels.attention_triton import TritonAttention

        return TritonAttention(device, dtype, head_dim)
    if kind == "torch":
        return TorchAttention(device, dtype, head_dim)
    raise ValueError(f"attention: expected one of {', '.join(ATTENTION_KINDS)}, got {kind!r}")


@dataclass
class Rope:
    """What every layer needs to rotate q and k: cos/sin tables, or (the native path) the positions
    and inverse frequencies the kernel computes them from."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    positions: torch.Tensor
    inv_freq: torch.Tensor


def rotary_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for `positions` [T]."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos, sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class LayerOps:
    """torch's operations (any device, any dtype); `attention`: the backend that attends (where
    none is given, torch's for float32 CPU activations of a head size not known in advance)."""

    name = "torch"

    def __init__(
        self, attention: TorchAttention | None = None, block_rows: int | None = None
    ) -> None:
        """`block_rows`: the rows an MLP takes at once (CPU prefills go block by block,
        `tuning.CPU_MLP_ROWS`); None: any."""
        self.attention = attention or TorchAttention(torch.device("cpu"), torch.float32, head_dim=0)
        self.block_rows = block_rows

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x) * weight; with `residual`, (rmsnorm(x + residual) * weight, x + residual)."""
        if residual is not None:
            residual = x + residual
            return self._norm(residual, weight, eps), residual
        return self._norm(x, weight, eps)

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def rope(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> Rope:
        """A forward's rotary embedding for `positions`, shared by the layers of one base."""
        cos, sin = rotary_tables(positions, inv_freq)
        return Rope(cos.to(dtype), sin.to(dtype), positions, inv_freq)

    def rotate(
        self, qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D] from qkv [T, (heads + 2 kv_heads) D], q and k
        rotated."""
        q, k, v = self._split(qkv, num_heads, num_kv_heads, head_dim)
        return apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin), v

    @staticmethod
    def _split(
        qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, kv_size = qkv.shape[0], num_kv_heads * head_dim
        q, k, v = qkv.split([num_heads * head_dim, kv_size, kv_size], dim=-1)
        return (
            q.reshape(tokens, num_heads, head_dim),
            k.reshape(tokens, num_kv_heads, head_dim),
            v.view(tokens, num_kv_heads, head_dim),
        )

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T (+ bias) for float weights (an LM head, a router, a mixture's experts;
        quantized weights run on their `QuantLinear`'s own paths)."""
        return F.linear(x, weight, bias)

    def gated_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up for gate_up [rows, 2 I]: SiLU, or GELU with tanh ("gelu_tanh")."""
        gate, up = gate_up.chunk(2, dim=-1)
        if activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scales: KVScales,
    ) -> torch.Tensor:
        """Stores the new k/v in the layer's caches and attends over them: [T, heads, D]."""
        return self.attention.attend(
            q, k, v, k_cache, v_cache, meta, scale, sliding_window, kv_scales
        )


class NativeCpuOps(LayerOps):
    """float32 CPU activations: the native library's norms, rotation and gated activations."""

    name = "native"

    def __init__(
        self, attention: TorchAttention | None = None, block_rows: int | None = CPU_MLP_ROWS
    ) -> None:
        super().__init__(attention, block_rows)
        self._linear = native_dense_matmul if native_quant_available() else F.linear

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return cpu_fused.rms_norm(x, weight, eps)
        return cpu_fused.add_rms_norm(x, residual, weight, eps)

    def rope(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> Rope:
        return Rope(None, None, positions, inv_freq)  # the kernel computes the angles

    def rotate(
        self, qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = qkv.contiguous()
        cpu_fused.rope_(qkv, rope.positions, rope.inv_freq, num_heads, num_kv_heads, head_dim)
        return self._split(qkv, num_heads, num_kv_heads, head_dim)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._linear(x, weight, bias)

    def gated_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        return cpu_fused.gated_mul(gate_up, activation)


class TritonOps(LayerOps):
    """CUDA with Triton: norms of 2-D activations and the rotation in one pass each."""

    name = "triton"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2:  # q/k norms see [T * heads, D] too: 2-D; anything else, torch's
            return super().rms_norm(x, weight, eps, residual)
        if residual is None:
            return norm_rope.rms_norm_triton(x, weight, eps)
        return norm_rope.fused_add_rms_norm_triton(x, residual, weight, eps)

    def rotate(
        self, qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._split(qkv, num_heads, num_kv_heads, head_dim)
        norm_rope.rotary_triton(q, rope.cos, rope.sin)  # in place on the qkv views
        norm_rope.rotary_triton(k, rope.cos, rope.sin)
        return q, k, v


def choose_layer_ops(
    device: torch.device, dtype: torch.dtype, attention: str, head_dim: int
) -> LayerOps:
    """The object a model's layers run on: Triton on CUDA where it imports and is not disabled,
    the native kernels for float32 on the CPU where they built, torch's otherwise; with the
    attention backend `attention` names (`create_attention`)."""
    backend = create_attention(attention, device, dtype, head_dim)
    probe = torch.empty(0, dtype=dtype, device=device)
    if use_triton(probe):
        return TritonOps(backend)
    if cpu_fused.usable(probe) and not native.native_disabled():
        return NativeCpuOps(backend)
    return LayerOps(backend, CPU_MLP_ROWS if device.type == "cpu" else None)
