"""Tensor parallelism for every family (their attention and MLP shard alike): shard a loaded
model across the ranks of a group.

Attention is split by KV-head groups (each rank keeps whole GQA groups: its KV heads and the
query heads that read them), the MLP by columns of its intermediate dimension. `qkv_proj` and
`gate_up_proj` become column-parallel (each rank computes its own heads / columns, no
communication); `o_proj` and `down_proj` become row-parallel (each rank's partial sum,
all-reduced). Embeddings, norms and the LM head stay whole on every rank. The split need not be
even: SmolLM2's 3 KV heads over 2 ranks give 2 and 1.

`shard_llama` works on the model `load_model` built, after loading, so the single-process model
code stays untouched; it returns the rank's `ModelArgs` (its heads and intermediate size), which
size its share of the KV pool.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.runtime.models.args import ModelArgs
from plait.runtime.models.llama import LlamaForCausalLM


def partition(n: int, parts: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s share when `n` items split over `parts` (the first get one more)."""
    base, extra = divmod(n, parts)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class RowParallelLinear(nn.Linear):
    """`y = all_reduce(x_shard @ w_shard.T) + b`: the input arrives split by the previous
    column-parallel layer; the bias is added once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> None:
        super().__init__(
            weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype
        )
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.full_bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # [T, out] partial sum of this rank's input columns
        self.group.allreduce([y]).wait()
        return y if self.full_bias is None else y + self.full_bias


def _column(rows: list[tuple[int, int]], linear: nn.Linear) -> nn.Linear:
    """A linear keeping only the output rows `rows` (each a [start, end) range) of `linear`."""
    index = torch.cat([torch.arange(a, b) for a, b in rows])
    weight = linear.weight.detach()[index].contiguous()
    bias = None if linear.bias is None else linear.bias.detach()[index].contiguous()
    out = nn.Linear(
        weight.shape[1],
        weight.shape[0],
        bias=bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    out.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


def check_shardable(args: ModelArgs, tp_size: int) -> None:
    if tp_size > args.num_kv_heads:
        raise ValueError(
            f"tp_size: {tp_size} ranks exceed the model's {args.num_kv_heads} KV heads "
            "(each rank needs at least one)"
        )
    if tp_size > args.intermediate_size:
        raise ValueError(f"tp_size: {tp_size} exceeds the MLP width {args.intermediate_size}")


def shard_llama(model: LlamaForCausalLM, rank: int, tp_size: int, group: Any) -> ModelArgs:
    """Replaces the model's attention and MLP projections by `rank`'s shards, in place."""
    args = model.args
    check_shardable(args, tp_size)
    for layer in model.model.layers:
        if (
            not isinstance(layer.self_attn.qkv_proj, nn.Linear)
            or type(layer.mlp.down_proj) is not nn.Linear
        ):
            raise ValueError("tp_size: tensor parallelism needs float weights (no quantization)")
    d = args.head_dim
    group_size = args.num_heads // args.num_kv_heads  # query heads per KV head
    k0, k1 = partition(args.num_kv_heads, tp_size, rank)
    q_rows = (k0 * group_size * d, k1 * group_size * d)
    q_size, kv_size = args.num_heads * d, args.num_kv_heads * d
    k_rows = (q_size + k0 * d, q_size + k1 * d)
    v_rows = (q_size + kv_size + k0 * d, q_size + kv_size + k1 * d)
    i0, i1 = partition(args.intermediate_size, tp_size, rank)
    inter = args.intermediate_size
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _column([q_rows, k_rows, v_rows], attn.qkv_proj)
        attn.o_proj = _row(attn.o_proj, q_rows, group)
        attn.num_heads, attn.num_kv_heads = (k1 - k0) * group_size, k1 - k0
        attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
        mlp.gate_up_proj = _column([(i0, i1), (inter + i0, inter + i1)], mlp.gate_up_proj)
        mlp.down_proj = _row(mlp.down_proj, (i0, i1), group)
        mlp.intermediate_size = i1 - i0
    local = replace(
        args, num_heads=(k1 - k0) * group_size, num_kv_heads=k1 - k0, intermediate_size=i1 - i0
    )
    model.args = local
    return local


def _row(linear: nn.Linear, cols: tuple[int, int], group: Any) -> RowParallelLinear:
    weight = linear.weight.detach()[:, cols[0] : cols[1]].contiguous()
    bias = None if linear.bias is None else linear.bias.detach()
    return RowParallelLinear(weight, bias, group)
