"""Loading a model and its tokenizer from the embedded default, a GGUF file or a Hugging Face
folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from plait.runtime.model_loader.locate import (
    CheckpointLocation,
    default_model_path,
    locate_checkpoint,
)
from plait.runtime.model_loader.weights import (
    check_names,
    float_weight,
    fuse_hf_weights,
    weight_types,
)
from plait.runtime.models.args import ModelArgs
from plait.runtime.models.registry import Family

if TYPE_CHECKING:
    from plait.runtime.tokenizer import Tokenizer

__all__ = ["LoadedModel", "default_model_path", "load_model", "locate_checkpoint"]


@dataclass
class LoadedModel:
    model: torch.nn.Module  # the family's `...ForCausalLM`
    args: ModelArgs
    tokenizer: Tokenizer
    location: CheckpointLocation
    family: Family
    # per tensor type in the checkpoint: how many of its tensors became what (`Engine.stats()`)
    weight_types: dict[str, dict[str, int]] = field(default_factory=dict)


def load_model(
    model_path: str | None,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
) -> LoadedModel:
    """Builds the model. `quantization=None` keeps a GGUF's blocks where the quantized kernels read
    them (`gguf_blocks.BLOCK_TYPES`), on the CPU, and dequantizes the other tensors to `dtype`;
    "float32" dequantizes every block; "int8" / "int4" also quantize the float weights of every
    linear layer (CPU float32 kernels; the reference elsewhere). Where the LM head is a tied
    embedding kept in blocks, the embedding lookups read the head's blocks too
    (`QuantEmbedding`) rather than a float copy of the table.

    The checkpoint's family, hyperparameters, tensor types and tensor names are checked from its
    header before any weight is read."""
    from plait.kernels.quant_weights import QuantizedWeight
    from plait.runtime.models.quantized import runs_in_blocks
    from plait.runtime.tokenizer import Tokenizer

    location = locate_checkpoint(model_path)
    sources: list[tuple[str, str, bool]] = []
    if location.kind == "gguf":
        from plait.runtime.model_loader.gguf_loader import iter_gguf_weights, open_gguf

        ckpt = open_gguf(location.path)
        show = ckpt.family.hf_to_gguf
    else:
        from plait.runtime.model_loader.hf_loader import iter_hf_weights, open_hf_dir

        ckpt = open_hf_dir(location.path)
        show = str
    family, args = ckpt.family, ckpt.args
    with torch.device("meta"):
        model = family.build(args)
    check_names(ckpt.hf_names(), model, args, location.path, show)
    if location.kind == "gguf":
        tokenizer = Tokenizer.from_gguf_metadata(ckpt.meta)
        keep = quantization in ("int8", "int4") or (quantization is None and device.type == "cpu")
        named = iter_gguf_weights(ckpt, keep_blocks=keep, sources=sources)
    else:
        tokenizer = Tokenizer.from_hf_dir(location.path)
        named = iter_hf_weights(ckpt, sources)
    state = fuse_hf_weights(named, args, dtype)
    prequantized = {n: w for n, w in state.items() if isinstance(w, (QuantizedWeight, list))}
    state = {n: w for n, w in state.items() if n not in prequantized}
    for name in [n for n in prequantized if not runs_in_blocks(model, n)]:
        state[name] = float_weight(prequantized.pop(name), dtype)  # a router, say: float
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if m not in prequantized]
    missing = [m for m in missing if not (args.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {location.path}: missing weights {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rebuild_rope()  # its tables were built on the meta device
    for name, module in model.named_modules():
        for key, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                raise ValueError(
                    f"{family.name}: buffer {name}.{key} was not rebuilt after loading"
                )
    for name in prequantized:  # placeholders on the meta device until the swap below
        module = model.get_submodule(name.rsplit(".", 1)[0])
        module.weight = torch.nn.Parameter(torch.empty(module.weight.shape), requires_grad=False)
    if prequantized or quantization in ("int8", "int4"):
        from plait.runtime.models.quantized import quantize_linears

        quantize_linears(model, None if quantization == "float32" else quantization, prequantized)
        if args.tie_word_embeddings and "lm_head.weight" in prequantized:
            _embed_from_head(model)
    model = model.to(device).eval()
    return LoadedModel(
        model, args, tokenizer, location, family, weight_types(sources, model, dtype)
    )


def _embed_from_head(model: torch.nn.Module) -> None:
    """Reads the embedding rows from the tied head's blocks (layer by layer, on the native stack
    and in its bursts alike), so no float copy of the table is kept."""
    from plait.runtime.models.quantized import QuantEmbedding, QuantLinear

    if isinstance(model.lm_head, QuantLinear):
        model.model.embed_tokens = QuantEmbedding(model.lm_head)
