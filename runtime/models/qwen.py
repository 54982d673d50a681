"""Qwen2/2.5, Qwen3 and Qwen3-MoE: the Llama decoder (`llama.py`) with biases on q, k and v (Qwen2)
or an RMSNorm over every query and key head before rotary (Qwen3); Qwen3-MoE's MLP is a mixture of
experts (`moe.py`) in every `decoder_sparse_step`-th layer not in `mlp_only_layers`. llama.cpp
keeps their q/k rows in Hugging Face order (rotate-half rope), so nothing is permuted at load."""

from __future__ import annotations

from typing import Any

from plait.runtime.models.args import (
    ModelArgs,
    common_from_gguf,
    common_from_hf,
    sliding_window_from_hf,
)
from plait.runtime.models.llama import LlamaForCausalLM
from plait.runtime.models.registry import LLAMA_GGUF_LAYERS, MOE_GGUF_LAYERS, Family, register


def qwen2_args_from_hf(config: dict[str, Any], architecture: str) -> ModelArgs:
    common = common_from_hf(config, architecture, "qwen2") | {"attention_bias": True}
    return ModelArgs(**common, **sliding_window_from_hf(config))


def qwen3_args_from_hf(config: dict[str, Any], architecture: str) -> ModelArgs:
    return ModelArgs(
        **common_from_hf(config, architecture, "qwen3"),
        **sliding_window_from_hf(config),
        qk_norm=True,
    )


def qwen3_moe_args_from_hf(config: dict[str, Any], architecture: str) -> ModelArgs:
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
    layers = config["num_hidden_layers"]
    return ModelArgs(
        **common_from_hf(config, architecture, "qwen3moe"),
        **sliding_window_from_hf(config),
        qk_norm=True,
        num_experts=config.get("num_experts") or config["num_local_experts"],
        num_experts_per_tok=config["num_experts_per_tok"],
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
    )


def qwen2_args_from_gguf(meta: dict[str, Any]) -> ModelArgs:
    return ModelArgs(
        **common_from_gguf(meta, "Qwen2ForCausalLM", "qwen2") | {"attention_bias": True}
    )


def qwen3_args_from_gguf(meta: dict[str, Any]) -> ModelArgs:
    return ModelArgs(**common_from_gguf(meta, "Qwen3ForCausalLM", "qwen3"), qk_norm=True)


QWEN2 = register(
    Family(
        name="qwen2",
        hf_architectures=("Qwen2ForCausalLM",),
        gguf_architectures=("qwen2",),
        args_from_hf=qwen2_args_from_hf,
        args_from_gguf=qwen2_args_from_gguf,
        build=LlamaForCausalLM,
    )
)
QWEN3 = register(
    Family(
        name="qwen3",
        hf_architectures=("Qwen3ForCausalLM",),
        gguf_architectures=("qwen3",),
        args_from_hf=qwen3_args_from_hf,
        args_from_gguf=qwen3_args_from_gguf,
        build=LlamaForCausalLM,
        gguf_layers={
            **LLAMA_GGUF_LAYERS,
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
        },
    )
)
_QWEN3_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
QWEN3_MOE = register(
    Family(
        name="qwen3moe",
        hf_architectures=("Qwen3MoeForCausalLM",),
        gguf_architectures=("qwen3moe",),
        args_from_hf=qwen3_moe_args_from_hf,
        args_from_gguf=lambda meta: ModelArgs(
            **common_from_gguf(meta, "Qwen3MoeForCausalLM", "qwen3moe"), qk_norm=True
        ),
        build=LlamaForCausalLM,
        gguf_layers={**MOE_GGUF_LAYERS, **_QWEN3_NORMS},
        tensor_parallel=False,
    )
)
