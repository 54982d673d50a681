"""The Llama family (Llama 1/2/3.x, Mistral, SmolLM) over paged KV, read top to bottom; Qwen2/3,
Phi-3 and the mixture-of-experts families (`qwen.py`, `phi3.py`, `mixtral.py`; their MLP is
`moe.py`'s) are this decoder with their own configs and weight names.

Weights use Hugging Face names except for two fusions made at load time:
`qkv_proj` = cat(q_proj, k_proj, v_proj) and `gate_up_proj` = cat(gate_proj, up_proj).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.kernels.batch_invariant import matmul_rows
from plait.kernels.layer_ops import Rope
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.models.args import (
    ModelArgs,
    common_from_gguf,
    common_from_hf,
    sliding_window_from_hf,
)
from plait.runtime.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from plait.runtime.models.moe import SparseMoE
from plait.runtime.models.quantized import QuantLinear
from plait.runtime.models.registry import MOE_GGUF_LAYERS, Family, register


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_id)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = SparseMoE(args) if args.is_moe(layer_id) else MLP(args)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next layer (or
        the final norm) adds the two, fused with its norm."""
        ops = batch.ops
        if residual is None:
            residual = x
            h = self.input_layernorm(x, ops=ops)
        else:
            h, residual = self.input_layernorm(x, residual, ops=ops)
        h = self.self_attn(h, rope, batch)
        h, residual = self.post_attention_layernorm(h, residual, ops=ops)
        return self.mlp(h, ops), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
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
        stack = batch.native_stack  # set by the runner for a step it plans on the native stack
        if stack is not None and (num_layers is None or num_layers > 0):
            return stack.forward_layers(x, positions, batch, num_layers, self.norm)
        rope = batch.ops.rope(positions, self.rotary_emb.inv_freq, x.dtype)
        residual = None
        for layer in self.layers[:num_layers]:
            x, residual = layer(x, residual, rope, batch)
        if residual is None:  # no layers ran
            return self.norm(x, ops=batch.ops)
        return self.norm(x, residual, ops=batch.ops)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rebuild_rope(self) -> None:
        """Recomputes the rotary tables (a model built on the meta device has none)."""
        self.model.rotary_emb = RotaryEmbedding(self.args)

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
        if batch.batch_invariant:
            return head_rows(self.lm_head, hidden)
        if type(self.lm_head) is nn.Linear:  # float32 on the CPU: the native GEMV for decode rows
            return batch.ops.linear(hidden, self.lm_head.weight, self.lm_head.bias).float()
        return self.lm_head(hidden).float()


def head_rows(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's logits for `hidden`, each row's as that row alone gets them."""
    weight = head.qw if isinstance(head, QuantLinear) else head.weight
    return matmul_rows(hidden, weight, head.bias)


def llama_args_from_hf(config: dict[str, Any], architecture: str) -> ModelArgs:
    return ModelArgs(**common_from_hf(config, architecture, "llama"))


def mistral_args_from_hf(config: dict[str, Any], architecture: str) -> ModelArgs:
    return ModelArgs(
        **common_from_hf(config, architecture, "mistral"),
        **sliding_window_from_hf(config),
    )


LLAMA = register(
    Family(
        name="llama",
        hf_architectures=("LlamaForCausalLM",),
        gguf_architectures=("llama",),
        args_from_hf=llama_args_from_hf,
        args_from_gguf=lambda meta: ModelArgs(
            **common_from_gguf(meta, "LlamaForCausalLM", "llama")
        ),
        build=LlamaForCausalLM,
        gguf_layers=MOE_GGUF_LAYERS,  # Mixtral's GGUFs are `llama` ones with experts
        gguf_rope_permuted=True,
    )
)
MISTRAL = register(
    Family(
        name="mistral",
        hf_architectures=("MistralForCausalLM",),
        gguf_architectures=("mistral",),
        args_from_hf=mistral_args_from_hf,
        args_from_gguf=lambda meta: ModelArgs(
            **common_from_gguf(meta, "MistralForCausalLM", "mistral")
        ),
        build=LlamaForCausalLM,
        gguf_rope_permuted=True,
    )
)
