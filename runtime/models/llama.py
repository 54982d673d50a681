"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) over paged KV, read top to bottom.

Weights use Hugging Face names except for two fusions made at load time:
`qkv_proj` = cat(q_proj, k_proj, v_proj) and `gate_up_proj` = cat(gate_proj, up_proj).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels import attention, cpu_fused, norm_rope
from plait.kernels.dispatch import use_triton
from plait.kernels.quant_matmul import dense_matmul
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.tuning import CPU_MLP_ROWS

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> LlamaArgs:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"config.json: unsupported architecture {archs!r}; plait supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        sliding = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older configs
        # have `rope_theta` and `rope_scaling` at the top level.
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope or None,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            sliding_window=sliding if arch != "LlamaForCausalLM" else None,
            architecture=arch,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x) * weight; with `residual`, (rmsnorm(x + residual) * weight, x + residual)."""
        if cpu_fused.usable(x):
            if residual is None:
                return cpu_fused.rms_norm(x, self.weight, self.eps)
            return cpu_fused.add_rms_norm(x, residual, self.weight, self.eps)
        if x.dim() == 2 and use_triton(x):  # CUDA: one pass over memory (kernels/norm_rope.py)
            if residual is None:
                return norm_rope.rms_norm_triton(x, self.weight, self.eps)
            return norm_rope.fused_add_rms_norm_triton(x, residual, self.weight, self.eps)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    dim = args.head_dim
    # NOTE: float32 throughout, as Hugging Face computes it, so positions far out match exactly.
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return emb.cos(), emb.sin()


@dataclass
class Rope:
    """What every layer needs to rotate q and k: cos/sin tables, or (on the CPU fused path) the
    positions and inverse frequencies the kernel computes them from."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    positions: torch.Tensor
    inv_freq: torch.Tensor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos, sin: [T, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim**-0.5
        self.sliding_window = args.sliding_window
        self.qkv_proj = nn.Linear(
            args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if rope.cos is None:  # the CPU fused path: rotate q and k inside qkv, in place
            qkv = qkv.contiguous()
            cpu_fused.rope_(qkv, rope.positions, rope.inv_freq, self.num_heads, self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if rope.cos is not None and use_triton(q):  # CUDA: in place on the qkv views
            norm_rope.rotary_triton(q, rope.cos, rope.sin)
            norm_rope.rotary_triton(k, rope.cos, rope.sin)
        elif rope.cos is not None:
            q = apply_rotary(q, rope.cos, rope.sin)
            k = apply_rotary(k, rope.cos, rope.sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = batch.kv_pool.layer(self.layer_id)
        out = attention.paged_attention(
            q, k, v, k_cache, v_cache, batch.attn, self.scale, self.sliding_window,
            batch.kv_pool.scales(self.layer_id),
        )  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.device.type == "cpu" and x.dim() == 2 and rows > CPU_MLP_ROWS:
            # NOTE: glibc maps allocations over 32 MB fresh from the OS each time: an 8192-token
            # prefill's [tokens, 2 x intermediate] activations page-faulted ~4% of the step away.
            # Blocks of rows keep every activation under that size, reused from the heap.
            out = torch.empty(rows, self.down_proj.out_features, dtype=x.dtype)
            for s in range(0, rows, CPU_MLP_ROWS):
                out[s : s + CPU_MLP_ROWS] = self._forward(x[s : s + CPU_MLP_ROWS])
            return out
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_fused.usable(gate_up):
            return self.down_proj(cpu_fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_id)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next layer (or
        the final norm) adds the two, fused with its norm."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        inv_freq = self.rotary_emb.inv_freq
        stack = batch.native_stack  # set by the runner for a step it plans on the native stack
        if stack is not None and (num_layers is None or num_layers > 0):
            x, residual = stack.run(x, positions, inv_freq, batch, min(num_layers or len(self.layers), len(self.layers)))
            return self.norm(x, residual)[0]
        if cpu_fused.usable(x):
            rope = Rope(None, None, positions, inv_freq)
        else:
            cos, sin = self.rotary_emb(positions)
            rope = Rope(cos.to(x.dtype), sin.to(x.dtype), positions, inv_freq)
        residual = None
        for layer in self.layers[:num_layers]:
            x, residual = layer(x, residual, rope, batch)
        if residual is None:  # no layers ran
            return self.norm(x)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Returns logits [num_selected, vocab] for the rows `batch.logits_indices` selects.

        `num_layers` runs only the first layers (self-speculative drafting: early exit).
        """
        hidden = self.model(input_ids, positions, batch, num_layers)  # [T, hidden]
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        if type(self.lm_head) is nn.Linear:  # float32 on the CPU: the native GEMV for decode rows
            return dense_matmul(hidden, self.lm_head.weight, self.lm_head.bias).float()
        return self.lm_head(hidden).float()
