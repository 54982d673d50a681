"""Turning Hugging Face-named weights into the fused layout of plait's model, checking a
checkpoint has every weight before any is read, and telling what each file type became."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from plait.kernels.quant_weights import QuantizedWeight
from plait.runtime.models.args import ModelArgs

_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_PIECE_TO_FUSED = {p: f for f, pieces in _FUSED.items() for p in pieces}
# one expert's projection in a mixture-of-experts checkpoint: `...mlp.experts.3.up_proj.weight`
_EXPERT = re.compile(
    r"(?P<owner>.*\.experts)\.(?P<expert>\d+)\.(?P<piece>gate_proj|up_proj|down_proj)\.weight"
)


def stacked_name(name: str) -> tuple[str, int] | None:
    """(the stacked weight of every expert, `...experts.up_proj.weight`, the expert's index) for
    one expert's weight; None for other names."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        return None
    return f"{match['owner']}.{match['piece']}.weight", int(match["expert"])


def fused_name(name: str) -> str:
    """The parameter of plait's model a Hugging Face weight goes into (`...q_proj.weight` →
    `...qkv_proj.weight`, an expert's `...experts.3.up_proj.weight` →
    `...experts.gate_up_proj.weight`); other names are their own."""
    stacked = stacked_name(name)
    if stacked is not None:
        name = stacked[0]
    prefix, _, leaf = name.rpartition(".")
    owner, _, piece = prefix.rpartition(".")
    if piece in _PIECE_TO_FUSED:
        return f"{owner}.{_PIECE_TO_FUSED[piece]}.{leaf}"
    return name


def check_names(
    names: Iterable[str], model: nn.Module, args: ModelArgs, where: str, show=str
) -> None:
    """Raises before any weight is read if the checkpoint lacks one of `model`'s weights (every
    piece of a fused one) or holds one it does not have. `names` are Hugging Face names; `show`
    turns one into the checkpoint's own spelling for the message."""
    have: set[str] = set()
    experts: dict[str, set[int]] = {}  # a stacked expert weight -> the experts the file has
    for name in names:
        stacked = stacked_name(name)
        if stacked is not None:
            experts.setdefault(stacked[0], set()).add(stacked[1])
            name = stacked[0]
        have.add(name)
    expected = set(model.state_dict())
    if args.tie_word_embeddings:
        expected.discard("lm_head.weight")
        have.discard("lm_head.weight")
    missing: list[str] = []
    for name in sorted(expected - have):
        prefix, _, leaf = name.rpartition(".")
        owner, _, fused = prefix.rpartition(".")
        pieces = [f"{owner}.{p}.{leaf}" for p in _FUSED.get(fused, ())]
        missing += [show(p) for p in pieces if p not in have] if pieces else [show(name)]
    for stacked, found in sorted(experts.items()):
        owner, _, rest = stacked.rpartition(".experts.")
        missing += [
            show(f"{owner}.experts.{e}.{rest}") for e in range(args.num_experts) if e not in found
        ]
    unexpected = sorted(show(n) for n in have if fused_name(n) not in expected)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {where}: missing tensor {', '.join(missing[:5])}{more}")
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ValueError(
            f"checkpoint {where}: tensor {', '.join(unexpected[:5])}{more} is not part of a "
            f"{args.family} model"
        )


_Weight = torch.Tensor | QuantizedWeight | list[QuantizedWeight]


def fuse_hf_weights(
    named: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], args: ModelArgs, dtype: torch.dtype
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Maps `model.layers.N.self_attn.q_proj.weight`-style names onto plait's fused parameters.

    Quantized weights fuse by stacking their rows; they keep their format (no `dtype` cast), or,
    where the pieces differ in format, are widened to one int8 format that holds each (`_stack`). A
    mixture of experts' stacked projection kept in blocks is a list, one `QuantizedWeight` per
    expert."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _stack_experts(named):
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.to(dtype)
        prefix, _, leaf = name.rpartition(".")  # leaf: weight or bias
        owner, _, piece = prefix.rpartition(".")
        if piece in _PIECE_TO_FUSED:
            parts.setdefault(f"{owner}.{_PIECE_TO_FUSED[piece]}.{leaf}", {})[piece] = tensor
        else:
            out[name] = tensor
    for fused, pieces in parts.items():
        order = _FUSED[fused.rsplit(".", 2)[1]]
        missing = [p for p in order if p not in pieces]
        if missing:
            raise ValueError(f"checkpoint: {fused} is missing {', '.join(missing)}")
        parts_in_order = [pieces[p] for p in order]
        stacked = _stack(parts_in_order)
        if stacked is not None:
            out[fused] = stacked
        else:  # float pieces, or blocks that stack in no one format: float
            floats = [float_weight(p, dtype) for p in parts_in_order]
            out[fused] = torch.cat(
                floats, dim=1 if floats[0].dim() == 3 else 0
            )  # rows (of every expert, stacked)
    if isinstance(out.get("lm_head.weight"), QuantizedWeight):
        return out  # a tied head kept quantized from the embedding's blocks
    if args.tie_word_embeddings or "lm_head.weight" not in out:
        out.pop("lm_head.weight", None)
    return out


def _stack(parts: list[_Weight]) -> QuantizedWeight | list[QuantizedWeight] | None:
    """A fused matrix's pieces kept in blocks (`QuantizedWeight.stack`: mixed formats widened to one
    that holds them), each expert's apart for stacked experts; None where they do not stack."""
    try:
        if all(isinstance(p, QuantizedWeight) for p in parts):
            return QuantizedWeight.stack(parts)
        if all(isinstance(p, list) for p in parts):
            return [QuantizedWeight.stack(list(each)) for each in zip(*parts)]
    except ValueError:
        pass
    return None


def float_weight(
    weight: torch.Tensor | QuantizedWeight | list[QuantizedWeight], dtype: torch.dtype
) -> torch.Tensor:
    """A weight as a float tensor: blocks dequantized, a list of experts' blocks stacked."""
    from plait.kernels.quant_weights import dequantize_ref

    if isinstance(weight, list):
        return torch.stack([dequantize_ref(w) for w in weight]).to(dtype)
    if isinstance(weight, QuantizedWeight):
        return dequantize_ref(weight).to(dtype)
    return weight


def _stack_experts(
    named: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
) -> Iterable[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The weights, each expert's projections stacked into one [E, out, in] tensor (in expert
    order) once all of a layer's have come; other weights as they come."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in named:
        stacked = stacked_name(name)
        if stacked is None:
            yield name, tensor
            continue
        if isinstance(tensor, QuantizedWeight):
            from plait.kernels.quant_weights import dequantize_ref

            tensor = dequantize_ref(tensor)
        pending.setdefault(stacked[0], {})[stacked[1]] = tensor
    for name, by_expert in pending.items():
        yield name, torch.stack([by_expert[e] for e in sorted(by_expert)])


def weight_types(
    sources: list[tuple[str, str, bool]], model: nn.Module, dtype: torch.dtype
) -> dict[str, dict[str, int]]:
    """For each tensor type in the checkpoint, how many of its tensors became what in the built
    model: `sources` holds (Hugging Face name, the file's type, kept in its blocks)."""
    from plait.runtime.models.quantized import QuantEmbedding, QuantExpertWeights, QuantLinear

    counts: dict[str, dict[str, int]] = {}
    float_name = str(dtype).removeprefix("torch.")
    for name, file_type, kept in sources:
        owner = fused_name(name).rpartition(".")[0]
        module = model.get_submodule(owner) if owner else model
        if isinstance(module, QuantLinear) and name.endswith(".weight"):
            scales = "" if module.scale_dtype == torch.float16 else ", float32 scales"
            became = (
                f"{module.format} blocks as stored{scales}"
                if kept
                else f"{module.format} quantized at load"
            )
        elif isinstance(module, QuantEmbedding):
            became = "rows read from the head's blocks"
        elif isinstance(module, QuantExpertWeights):
            first = module.experts[0]
            scales = "" if first.scale_dtype == torch.float16 else ", float32 scales"
            became = (
                f"{first.format} blocks as stored{scales}, per expert"
                if kept
                else f"{first.format} quantized at load, per expert"
            )
        else:
            became = float_name
        by_type = counts.setdefault(file_type, {})
        by_type[became] = by_type.get(became, 0) + 1
    return counts
