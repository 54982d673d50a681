"""The building blocks every family's decoder is made of: RMSNorm, rotary embeddings, attention over
paged KV (with optional q/k norms and a sliding window), and the gated MLP with the family's
activation. Each block holds its weights and calls the operations object it is given
(`kernels/layer_ops.py`: native CPU, Triton or torch, chosen once per engine and handed over in
each step's `ForwardBatch`); the projections are modules of their own (`nn.Linear` or
`QuantLinear`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.kernels.layer_ops import LayerOps, Rope
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.models.args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, ops: LayerOps
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x) * weight; with `residual`, (rmsnorm(x + residual) * weight, x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(args: ModelArgs, local: bool = False) -> torch.Tensor:
    """The inverse frequencies [head_dim / 2]; `local`: those of the sliding-window layers where
    the family gives them their own base (`rope_local_theta`, unscaled)."""
    dim = args.head_dim
    theta = args.rope_local_theta if local else args.rope_theta
    # NOTE: float32 throughout, as Hugging Face computes it, so positions far out match exactly.
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if local:
        return inv_freq
    if args.rope_freq_factors is not None:
        return inv_freq / torch.tensor(args.rope_freq_factors, dtype=torch.float32)
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(is_medium, smoothed, inv_freq)
    else:
        raise NotImplementedError(
            f"rope_scaling: type {kind!r} is not supported (supported: default, linear, llama3)"
        )
    return inv_freq


class RotaryEmbedding(nn.Module):
    """The inverse frequencies of one rope base, as a buffer that follows the model's device (the
    operations object turns them into a forward's rotation, `LayerOps.rope`)."""

    def __init__(self, args: ModelArgs, local: bool = False) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(args, local), persistent=False)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.attn_scale or args.head_dim**-0.5
        self.sliding_window = args.layer_window(layer_id)
        self.qkv_proj = nn.Linear(
            args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        # one weight [head_dim] shared by every query (key) head
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch) -> torch.Tensor:
        num_tokens, ops = x.shape[0], batch.ops
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv, ops)
        q, k, v = ops.rotate(qkv, rope, self.num_heads, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = batch.kv_pool.layer(self.layer_id)
        out = ops.attend(
            q,
            k,
            v,
            k_cache,
            v_cache,
            batch.attn_for(self.layer_id),
            self.scale,
            self.sliding_window,
            batch.kv_pool.scales(self.layer_id),
        )  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _norm_qk(self, qkv: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """qkv [T, q_size + 2 kv_size] with each query and key head RMS-normalized (before
        rotary)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens * self.num_heads, self.head_dim), ops=ops)
        k = self.k_norm(k.reshape(num_tokens * self.num_kv_heads, self.head_dim), ops=ops)
        return torch.cat([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v], dim=-1)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), with the family's activation (SiLU, or GELU with tanh)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.activation = args.activation
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        rows, block = x.shape[0], ops.block_rows
        if block is not None and x.dim() == 2 and rows > block:
            # NOTE: glibc maps allocations over 32 MB fresh from the OS each time, so a long
            # prefill's [tokens, 2 x intermediate] activations would page-fault on every step.
            # Blocks of rows keep every activation under that size, reused from the heap.
            out = torch.empty(rows, self.down_proj.out_features, dtype=x.dtype)
            for s in range(0, rows, block):
                out[s : s + block] = self._forward(x[s : s + block], ops)
            return out
        return self._forward(x, ops)

    def _forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.down_proj(ops.gated_mul(self.gate_up_proj(x), self.activation))
