"""Turning Hugging Face-named weights into the fused layout of plait's model."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from plait.kernels.quant_matmul import QuantizedWeight
from plait.runtime.models.llama import LlamaArgs

_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fuse_hf_weights(
    named: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], args: LlamaArgs, dtype: torch.dtype
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Maps `model.layers.N.self_attn.q_proj.weight`-style names onto plait's fused parameters.

    Quantized weights fuse by stacking their rows; they keep their format (no `dtype` cast)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    piece_to_fused = {p: (f, i) for f, pieces in _FUSED.items() for i, p in enumerate(pieces)}
    for name, tensor in named:
        if "rotary_emb.inv_freq" in name:
            continue
        if isinstance(tensor, torch.Tensor):
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
        parts_in_order = [pieces[p] for p in order]
        if all(isinstance(p, QuantizedWeight) for p in parts_in_order):
            out[fused_name] = QuantizedWeight.cat(parts_in_order)
        else:  # mixed formats in one fused matrix: fall back to float
            from plait.kernels.quant_matmul import dequantize_ref

            out[fused_name] = torch.cat(
                [dequantize_ref(p).to(dtype) if isinstance(p, QuantizedWeight) else p for p in parts_in_order]
            )
    if isinstance(out.get("lm_head.weight"), QuantizedWeight):
        return out  # a tied head kept quantized from the embedding's blocks
    if args.tie_word_embeddings or "lm_head.weight" not in out:
        out.pop("lm_head.weight", None)
    return out
