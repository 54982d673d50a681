"""Phi-3: the Llama decoder (`llama.py`) whose checkpoints already hold q, k, v in one `qkv_proj`
and gate, up in one `gate_up_proj`, plait's own fused layout, so they load as they are. Its
attention looks back through a sliding window where the config gives one. llama.cpp stores the
fused matrices as `attn_qkv` and `ffn_up`, in rotate-half rope order."""

from __future__ import annotations

from typing import Any

from plait.runtime.models.args import ModelArgs, common_from_gguf, common_from_hf
from plait.runtime.models.llama import LlamaForCausalLM
from plait.runtime.models.registry import LLAMA_GGUF_LAYERS, Family, register


def _check_rotary(fraction: float, where: str) -> None:
    if fraction != 1.0:
        raise ValueError(
            f"{where}: partial rotary embeddings ({fraction}) are not supported for phi3"
        )


def phi3_args_from_hf(config: dict[str, Any], architecture: str) -> ModelArgs:
    rope = config.get("rope_parameters") or {}
    fraction = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    _check_rotary(fraction, "config.json partial_rotary_factor")
    return ModelArgs(
        **common_from_hf(config, architecture, "phi3"), sliding_window=config.get("sliding_window")
    )


def phi3_args_from_gguf(meta: dict[str, Any]) -> ModelArgs:
    common = common_from_gguf(meta, "Phi3ForCausalLM", "phi3")
    rotary = meta.get("phi3.rope.dimension_count", common["head_dim"])
    _check_rotary(rotary / common["head_dim"], "GGUF phi3.rope.dimension_count")
    return ModelArgs(**common)


PHI3_GGUF_LAYERS = {
    **{
        k: v
        for k, v in LLAMA_GGUF_LAYERS.items()
        if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
    },
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}

PHI3 = register(
    Family(
        name="phi3",
        hf_architectures=("Phi3ForCausalLM",),
        gguf_architectures=("phi3",),
        args_from_hf=phi3_args_from_hf,
        args_from_gguf=phi3_args_from_gguf,
        build=LlamaForCausalLM,
        gguf_layers=PHI3_GGUF_LAYERS,
    )
)
