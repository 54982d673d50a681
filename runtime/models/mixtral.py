"""Mixtral: the Llama decoder (`llama.py`) whose MLP is a mixture of experts (`moe.py`): a softmax
router over `num_local_experts` SiLU-gated experts, the top `num_experts_per_tok` renormalized.

Hugging Face checkpoints name the block `block_sparse_moe` and an expert's projections `w1`
(gate), `w3` (up) and `w2` (down); they are read under plait's names. A Mixtral GGUF is a
`llama` one with `llama.expert_count` set (the llama family reads it, `registry.MOE_GGUF_LAYERS`).
"""

from __future__ import annotations

from typing import Any

from plait.runtime.models.args import ModelArgs, common_from_hf, sliding_window_from_hf
from plait.runtime.models.llama import LlamaForCausalLM
from plait.runtime.models.registry import MOE_GGUF_LAYERS, Family, register

_EXPERT_PIECES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def mixtral_args_from_hf(config: dict[str, Any], architecture: str) -> ModelArgs:
    return ModelArgs(
        **common_from_hf(config, architecture, "mixtral"),
        **sliding_window_from_hf(config),
        num_experts=config["num_local_experts"],
        num_experts_per_tok=config["num_experts_per_tok"],
    )


def mixtral_name(name: str) -> str | None:
    """`...block_sparse_moe.experts.3.w1.weight` → `...mlp.experts.3.gate_proj.weight`."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    name = name.replace(".block_sparse_moe.", ".mlp.")
    head, dot, leaf = name.rpartition(".")
    owner, _, piece = head.rpartition(".")
    if ".experts." in name and piece in _EXPERT_PIECES:
        return f"{owner}.{_EXPERT_PIECES[piece]}{dot}{leaf}"
    return name


def mixtral_args_from_gguf(meta: dict[str, Any]) -> ModelArgs:
    raise ValueError("GGUF: Mixtral files are `llama` ones; the llama family reads them")


MIXTRAL = register(
    Family(
        name="mixtral",
        hf_architectures=("MixtralForCausalLM",),
        gguf_architectures=(),
        args_from_hf=mixtral_args_from_hf,
        args_from_gguf=mixtral_args_from_gguf,
        build=LlamaForCausalLM,
        gguf_layers=MOE_GGUF_LAYERS,
        gguf_rope_permuted=True,
        hf_name=mixtral_name,
        tensor_parallel=False,
    )
)
