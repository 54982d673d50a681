"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a softmax router picks `top_k` of `E` gated
MLPs per token, and the token's output is their weighted sum.

The experts' weights are stacked, `[E, 2 x intermediate, hidden]` (gate and up) and
`[E, hidden, intermediate]` (down). A forward pass sorts the (token, expert) pairs by expert and
runs each expert once, over all of its tokens, as one matmul: a grouped GEMM, one call per expert
that has tokens (at most min(E, tokens x top_k)), never one per token. Experts a GGUF file holds in
quantized blocks keep them (one `QuantLinear` per expert and projection, on the quantized kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.layer_ops import LayerOps
from plait.runtime.models.args import ModelArgs


class ExpertWeights(nn.Module):
    """One projection of every expert: `weight` [E, out, in]. Kept in quantized blocks, it is a
    `QuantExpertWeights` instead (`runtime/models/quantized.py`), with the same `project`."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def project(self, expert: int, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x [rows, in] through expert `expert`'s projection (`ops.linear`: on the CPU the
        native stack's float32 kernel for a few rows, as its mixture runs it)."""
        return ops.linear(x, self.weight[expert])


class Experts(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        size = args.moe_intermediate_size or args.intermediate_size
        self.intermediate_size = size
        self.num_experts = args.num_experts
        self.activation = args.activation
        self.gate_up_proj = ExpertWeights(args.num_experts, 2 * size, args.hidden_size)
        self.down_proj = ExpertWeights(args.num_experts, args.hidden_size, size)

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        """x [T, hidden]; ids, weights [T, top_k]: each token's experts and their weights."""
        num_tokens, top_k = ids.shape
        flat = ids.reshape(-1)  # [T * top_k], token t's picks at t * top_k ..
        order = flat.argsort(stable=True)  # (token, expert) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[order // top_k]  # [T * top_k, hidden], each pair's token, in expert order
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                out[start:end] = self._expert(expert, rows[start:end], ops)
                start = end
        mixed = torch.empty_like(out)
        mixed[order] = out  # back in (token, pick) order
        # [T, top_k, hidden] weighted by the router, summed over the picks
        return (mixed.view(num_tokens, top_k, -1) * weights[..., None]).sum(1)

    def _expert(self, expert: int, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        gate_up = self.gate_up_proj.project(expert, x, ops)
        return self.down_proj.project(expert, ops.gated_mul(gate_up, self.activation), ops)


class SparseMoE(nn.Module):
    """The router (`gate`, [E, hidden]) and the experts; replaces a decoder layer's `MLP`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = Experts(args)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        # [T, E], the router in float32 (by the kernel the native stack's mixture runs it with)
        logits = ops.linear(x, self.gate.weight) if type(self.gate) is nn.Linear else self.gate(x)
        probs = F.softmax(logits.float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)  # [T, top_k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(x, ids, weights.to(x.dtype), ops)
