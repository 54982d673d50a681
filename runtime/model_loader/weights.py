"""Turning Hugging Face-named weights into the fused layout of plait's model."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from plait.runtime.models.llama import LlamaArgs

_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fuse_hf_weights(
    named: Iterable[tuple[str, torch.Tensor]], args: LlamaArgs, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Maps `model.layers.N.self_attn.q_proj.weight`-style names onto plait's fused parameters."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    piece_to_fused = {p: (f, i) for f, pieces in _FUSED.items() for i, p in enumerate(pieces)}
    for name, tensor in named:
        if "rotary_emb.inv_freq" in name:
            continue
        tensor = tensor.to(dtype)
        prefix, _, leaf = name.rpartition(".")  # leaf: weight or bias
        owner, _, piece = prefix.rpartition(".")
        if piece in piece_to_fused:
            fused, _ = piece_to_fused[piece]
            parts.setdefault(f"{owner}.{fused}.{leaf}", {})[piece] = tensor
        else:
            out[name] = tensor
    for fused_name, pieces in parts.items():
        fused = fused_name.rsplit(".", 2)[1]
        order = _FUSED[fused]
        missing = [p for p in order if p not in pieces]
        if missing:
            raise ValueError(f"checkpoint: {fused_name} is missing {', '.join(missing)}")
        out[fused_name] = torch.cat([pieces[p] for p in order], dim=0)
    if args.tie_word_embeddings or "lm_head.weight" not in out:
        out.pop("lm_head.weight", None)
    return out
