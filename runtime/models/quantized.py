"""Weight-only quantized linear layers swapped into a loaded model.

`quantize_linears(model, mode, prequantized)` replaces every projection (qkv, o, gate_up, down)
and the LM head with a `QuantLinear`, and each projection of a mixture's experts with a
`QuantExpertWeights`. Weights found in `prequantized` (blocks a GGUF file already
holds in a format the kernel reads: `model_loader/gguf_blocks.py`) are used as they are; the others
are quantized from their float values, or, with `mode=None`, stay float. Norms stay float32, and
so does the embedding table (a decode step reads one embedding row, not the table); with tied
embeddings the LM head gets its own quantized copy of the table, which `QuantEmbedding` can read
rows from instead of a float table.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.kernels.layer_ops import LayerOps
from plait.kernels.quant_matmul import QuantMatmul, dequantize
from plait.kernels.quant_weights import QuantizedWeight, quantize_int4, quantize_int8
from plait.runtime.models.moe import ExpertWeights

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class QuantLinear(nn.Module):
    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.format, self.group, self.scale_dtype = qw.format, qw.group, qw.scales.dtype
        self.out_features, self.in_features = qw.shape
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("mins", qw.mins)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        )
        self._refresh()

    def _refresh(self) -> None:
        # NOTE: plain attributes built once, not per call: forward runs ~120 times a decode step;
        # the products' paths are chosen here, for the device the buffers are on
        self.qw = QuantizedWeight(self.format, self.qweight, self.scales, self.mins, self.group)
        self.matmul = QuantMatmul(self.qw)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202  (nn.Module's signature)
        super()._apply(fn, recurse)
        for name in ("scales", "mins"):  # the kernels' format, whatever dtype the model is cast to
            if self._buffers[name] is not None:
                self._buffers[name] = self._buffers[name].to(self.scale_dtype)
        self._refresh()  # `.to(device)` replaced the buffers
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, format={self.format}, "
            f"group={self.group}"
        )


class QuantEmbedding(nn.Module):
    """An embedding table read from a tied LM head's blocks: each looked-up row dequantized (the
    rows are the file's, as the float table would hold them). The head is not a submodule here,
    so its bytes count once."""

    def __init__(self, head: QuantLinear) -> None:
        super().__init__()
        self.heads = (head,)  # a tuple: not registered as a submodule
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.heads[0].qw.rows(input_ids.reshape(-1))
        return dequantize(rows).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, from the LM head's blocks"


class QuantExpertWeights(nn.Module):
    """One projection of every expert of a mixture (`moe.ExpertWeights`) in quantized blocks: a
    `QuantLinear` per expert."""

    def __init__(self, weights: list[QuantizedWeight]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(QuantLinear(qw, None) for qw in weights)

    def project(self, expert: int, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.experts[expert](x)


def quantize_weight(w: torch.Tensor, mode: str) -> QuantizedWeight:
    return quantize_int8(w) if mode == "int8" else quantize_int4(w)


def runs_in_blocks(model: nn.Module, name: str) -> bool:
    """Whether the weight `name` of `model` can be kept in quantized blocks: a projection, the LM
    head or a projection of a mixture's experts (`quantize_linears` swaps those); other linears
    (a mixture's router) take float weights."""
    owner = name.rpartition(".")[0]
    module = model.get_submodule(owner)
    leaf = owner.rpartition(".")[2]
    if isinstance(module, ExpertWeights):
        return True
    return isinstance(module, nn.Linear) and (leaf in PROJECTIONS or owner == "lm_head")


def quantized_linears(model: nn.Module) -> bool:
    """Whether any of the model's linears runs on the quantized kernels."""
    return any(isinstance(m, QuantLinear) for m in model.modules())


def quantize_linears(
    model: nn.Module, mode: str | None, prequantized: dict[str, QuantizedWeight] | None = None
) -> None:
    """Swaps the model's projections and LM head for `QuantLinear`s (in place); with `mode=None`
    only those in `prequantized`, the others stay float."""
    prequantized = prequantized or {}
    targets = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and (name.rsplit(".", 1)[-1] in PROJECTIONS or name == "lm_head")
    ]
    for name in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear: nn.Linear = getattr(parent, leaf)
        qw = prequantized.get(f"{name}.weight")
        if qw is None and mode is None:
            continue
        if qw is None:
            qw = quantize_weight(linear.weight.detach().float(), mode)
        setattr(parent, leaf, QuantLinear(qw, linear.bias))
    experts = [name for name, m in model.named_modules() if isinstance(m, ExpertWeights)]
    for name in experts:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        weights = prequantized.get(f"{name}.weight")
        if weights is None and mode is None:
            continue
        if weights is None:
            stacked = getattr(parent, leaf).weight.detach().float()
            weights = [quantize_weight(w, mode) for w in stacked]
        setattr(parent, leaf, QuantExpertWeights(weights))


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The weights one decode step reads: every linear and norm (quantized or not: packed weights,
    scales, minimums, biases), plus one embedding row per token (counted as one row)."""
    found: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, QuantLinear):
            qw = module.qw
            found += [t for t in (qw.qweight, qw.scales, qw.mins, module.bias) if t is not None]
        elif isinstance(module, nn.Linear):
            found += [t for t in (module.weight, module.bias) if t is not None]
        elif isinstance(module, nn.Embedding):
            found.append(module.weight[0])
        elif (
            hasattr(module, "weight")
            and isinstance(module.weight, nn.Parameter)
            and not list(module.children())
        ):
            found.append(module.weight)
    return [t.detach() for t in found]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads (`weight_tensors`): the numerator of a roofline."""
    return sum(t.nbytes for t in weight_tensors(model))
