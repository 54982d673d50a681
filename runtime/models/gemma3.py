"""Gemma 3 (text), read top to bottom: embeddings scaled by sqrt(hidden); in each layer an RMSNorm
before and after attention and before and after the MLP; q/k RMS norms; sliding-window layers
(five of every six) with their own rope base, global layers with the model's; a GELU-tanh gated
MLP; the head tied to the embeddings. `Gemma3ForConditionalGeneration` checkpoints run their text
model (the vision tower is not read).

Gemma's norms multiply by (1 + w): GGUF files store 1 + w already, and Hugging Face weights get
the 1 added at load, so the shared `RMSNorm` (which multiplies by its weight) serves unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from plait.kernels.layer_ops import Rope
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.models.args import ModelArgs, common_from_gguf, common_from_hf
from plait.runtime.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from plait.runtime.models.llama import LlamaForCausalLM
from plait.runtime.models.registry import LLAMA_GGUF_LAYERS, Family, register


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_id)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normed MLP output, the residual stream before it), as the Llama layer."""
        ops = batch.ops
        if residual is None:
            residual = x
            h = self.input_layernorm(x, ops=ops)
        else:
            h, residual = self.input_layernorm(x, residual, ops=ops)
        h = self.post_attention_layernorm(self.self_attn(h, rope, batch), ops=ops)
        h, residual = self.pre_feedforward_layernorm(h, residual, ops=ops)
        return self.post_feedforward_layernorm(self.mlp(h, ops), ops=ops), residual


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.embed_scale = args.embed_scale
        self.rotary_emb = RotaryEmbedding(args)  # global layers
        self.local_rotary_emb = RotaryEmbedding(args, local=True)  # sliding-window layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:  # rounded to the activations' dtype first, as Gemma does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        stack = batch.native_stack  # set by the runner for a step it plans on the native stack
        if stack is not None and (num_layers is None or num_layers > 0):
            return stack.forward_layers(x, positions, batch, num_layers, self.norm)
        ropes: list[Rope] = [
            batch.ops.rope(positions, emb.inv_freq, x.dtype)
            for emb in (self.rotary_emb, self.local_rotary_emb)
        ]
        residual = None
        for layer in self.layers[:num_layers]:
            rope = ropes[0] if layer.self_attn.sliding_window is None else ropes[1]
            x, residual = layer(x, residual, rope, batch)
        if residual is None:  # no layers ran
            return self.norm(x, ops=batch.ops)
        return self.norm(x, residual, ops=batch.ops)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.model = Gemma3Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rebuild_rope(self) -> None:
        self.model.rotary_emb = RotaryEmbedding(self.args)
        self.model.local_rotary_emb = RotaryEmbedding(self.args, local=True)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        logits = super().forward(input_ids, positions, batch, num_layers)  # [num_selected, vocab]
        cap = self.args.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _gemma3_fields(hidden: int) -> dict[str, Any]:
    return dict(
        qk_norm=True,
        activation="gelu_tanh",
        embed_scale=math.sqrt(hidden),
        tie_word_embeddings=True,
    )


def gemma3_args_from_hf(config: dict[str, Any], architecture: str) -> ModelArgs:
    if architecture == MULTIMODAL:  # the text model's own config, under `text_config`
        text = dict(config.get("text_config") or {})
        if not text:
            raise ValueError(f"config.json: {MULTIMODAL} without a text_config")
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
        return _text_args_from_hf(text, architecture)
    return _text_args_from_hf(config, architecture)


def _text_args_from_hf(config: dict[str, Any], architecture: str) -> ModelArgs:
    if config.get("attn_logit_softcapping") is not None:
        raise ValueError("config.json: attn_logit_softcapping is not supported for gemma3")
    if config.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention is not supported for gemma3")
    rope = config.get("rope_parameters") or {}
    full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
    flat["rope_parameters"] = full or {
        "rope_theta": config.get("rope_theta", 1e6),
        **(config.get("rope_scaling") or {}),
    }
    local_theta = local.get("rope_theta", config.get("rope_local_base_freq", 10000.0))
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.json: sliding-layer rope {local.get('rope_type')!r} is not supported for "
            "gemma3"
        )
    types = config.get("layer_types") or [
        "full_attention"
        if (i + 1) % config.get("sliding_window_pattern", 6) == 0
        else "sliding_attention"
        for i in range(config["num_hidden_layers"])
    ]
    common = common_from_hf(flat, architecture, "gemma3") | _gemma3_fields(config["hidden_size"])
    return ModelArgs(
        **common,
        sliding_window=config.get("sliding_window"),
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        rope_local_theta=local_theta,
        attn_scale=config.get("query_pre_attn_scalar", common["head_dim"]) ** -0.5,
        final_logit_softcap=config.get("final_logit_softcapping"),
    )


def gemma3_args_from_gguf(meta: dict[str, Any]) -> ModelArgs:
    common = common_from_gguf(meta, "Gemma3ForCausalLM", "gemma3")
    pattern = meta.get(
        "gemma3.attention.sliding_window_pattern", 6
    )  # as llama.cpp: 5 local, then 1 global
    layers = common["num_layers"]
    if isinstance(pattern, int):
        sliding = tuple((i + 1) % pattern != 0 for i in range(layers))
    else:
        sliding = tuple(bool(p) for p in pattern)
    # the query scale llama.cpp uses: 1/sqrt(hidden / heads) for the 62-layer (27B) model, else
    # 1/sqrt(head_dim)
    scalar = common["hidden_size"] // common["num_heads"] if layers == 62 else common["head_dim"]
    return ModelArgs(
        **common | _gemma3_fields(common["hidden_size"]),
        sliding_layers=sliding,
        rope_local_theta=10000.0,
        attn_scale=scalar**-0.5,
        final_logit_softcap=meta.get("gemma3.final_logit_softcapping"),
    )


def _plus_one_norms(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor


# Gemma3ForConditionalGeneration: the text model inside the multimodal one. Its checkpoints name
# the text weights `language_model.model.*` (as Google published them) or `model.language_model.*`
# (as transformers >= 4.52 builds the model); the vision tower and its projector are not read.
MULTIMODAL = "Gemma3ForConditionalGeneration"
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_NOT_TEXT = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _text_model_name(name: str) -> str | None:
    if name.endswith("rotary_emb.inv_freq") or name.startswith(_NOT_TEXT):
        return None
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    if name == "language_model.lm_head.weight":
        return "lm_head.weight"
    return name


GEMMA3_GGUF_LAYERS = {
    **LLAMA_GGUF_LAYERS,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

GEMMA3 = register(
    Family(
        name="gemma3",
        hf_architectures=("Gemma3ForCausalLM", MULTIMODAL),
        gguf_architectures=("gemma3",),
        args_from_hf=gemma3_args_from_hf,
        args_from_gguf=gemma3_args_from_gguf,
        build=Gemma3ForCausalLM,
        gguf_layers=GEMMA3_GGUF_LAYERS,
        hf_name=_text_model_name,
        hf_tensor=_plus_one_norms,
    )
)
