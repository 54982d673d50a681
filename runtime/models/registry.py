"""Which model families plait runs, and how a checkpoint names its weights.

Each family's file (`llama.py`, `qwen.py`, `phi3.py`, `gemma3.py`, `mixtral.py`) registers a
`Family`: the Hugging Face `architectures` and GGUF `general.architecture` names it answers to,
how it reads its hyperparameters from either, the model it builds, and its GGUF tensor names. The
loader asks `family_for_hf` / `family_for_gguf` before it reads any weight; an unknown
architecture is refused there with the list of what is supported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.runtime.models.args import ModelArgs

FAMILY_MODULES = ("llama", "qwen", "phi3", "gemma3", "mixtral")

# GGUF `blk.N.<kind>` → the module under `model.layers.N` (Hugging Face names), as llama.cpp
# names the Llama decoder's tensors; families add or override entries.
LLAMA_GGUF_LAYERS: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# the mixture-of-experts MLP (Mixtral's `llama` GGUFs, `qwen3moe`): the router and each
# projection of every expert stacked [E, out, in]
MOE_GGUF_LAYERS: Mapping[str, str] = {
    **LLAMA_GGUF_LAYERS,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
GGUF_GLOBALS: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_IGNORED = ("rope_freqs.weight",)  # read into `ModelArgs.rope_freq_factors`, not a weight


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    args_from_hf: Callable[
        [dict[str, Any], str], ModelArgs
    ]  # (config.json, the matched class name)
    args_from_gguf: Callable[[dict[str, Any]], ModelArgs]  # GGUF metadata
    build: Callable[[ModelArgs], nn.Module]
    gguf_layers: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYERS)
    # llama.cpp stores this family's q/k rows in interleaved-rope order (undone at load)
    gguf_rope_permuted: bool = False
    # a Hugging Face weight name as this family's model calls it; None: not a weight it reads
    hf_name: Callable[[str], str | None] = lambda name: (
        None if name.endswith("rotary_emb.inv_freq") else name
    )
    # a Hugging Face tensor as this family's model holds it (Gemma's norms: 1 + w)
    hf_tensor: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, tensor: tensor
    tensor_parallel: bool = True

    def gguf_to_hf(self, name: str) -> str | None:
        """The Hugging Face name of GGUF tensor `name`; None for a tensor that is not a weight."""
        if name in GGUF_GLOBALS:
            return GGUF_GLOBALS[name]
        if name in GGUF_IGNORED:
            return None
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in self.gguf_layers:
            return f"model.layers.{parts[1]}.{self.gguf_layers[parts[2]]}.{parts[3]}"
        if len(parts) == 4 and parts[0] == "blk" and parts[2] == "rope_freqs":
            return None
        raise ValueError(f"tensor {name} is not one the {self.name} family has")

    def hf_to_gguf(self, name: str) -> str:
        """The GGUF spelling of Hugging Face weight `name` (for messages); `name` if it has none."""
        for gguf_name, hf in GGUF_GLOBALS.items():
            if hf == name:
                return gguf_name
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"]:
            module, leaf = ".".join(parts[3:-1]), parts[-1]
            for kind, hf in self.gguf_layers.items():
                if hf == module:
                    return f"blk.{parts[2]}.{kind}.{leaf}"
        return name


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    _FAMILIES[family.name] = family
    return family


def families() -> list[Family]:
    """Every registered family, in registration order."""
    for module in FAMILY_MODULES:
        importlib.import_module(f"plait.runtime.models.{module}")
    return list(_FAMILIES.values())


def supported_hf() -> list[str]:
    return [a for f in families() for a in f.hf_architectures]


def supported_gguf() -> list[str]:
    return [a for f in families() for a in f.gguf_architectures]


def family_for_hf(config: dict[str, Any], where: str) -> tuple[Family, str]:
    """(the family, the matched class name) for config.json's `architectures`."""
    archs = config.get("architectures") or []
    for family in families():
        for arch in archs:
            if arch in family.hf_architectures:
                return family, arch
    raise ValueError(
        f"{where}: unsupported architecture {archs!r}; plait supports {', '.join(supported_hf())}"
    )


def family_for_gguf(arch: str | None, where: str) -> Family:
    for family in families():
        if arch in family.gguf_architectures:
            return family
    raise ValueError(
        f"{where}: unsupported architecture {arch!r}; plait supports {', '.join(supported_gguf())}"
    )


def family_named(name: str) -> Family:
    for family in families():
        if family.name == name:
            return family
    raise KeyError(f"family {name!r} is not registered")
