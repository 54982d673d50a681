"""Loading a model and its tokenizer from the embedded default, a GGUF file or a Hugging Face folder."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from plait.runtime.model_loader.locate import (
    CheckpointLocation,
    default_model_path,
    locate_checkpoint,
)
from plait.runtime.model_loader.weights import fuse_hf_weights
from plait.runtime.models.llama import LlamaArgs, LlamaForCausalLM

if TYPE_CHECKING:
    from plait.runtime.tokenizer import Tokenizer

__all__ = ["LoadedModel", "default_model_path", "load_model", "locate_checkpoint"]


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    args: LlamaArgs
    tokenizer: Tokenizer
    location: CheckpointLocation


def load_model(
    model_path: str | None, dtype: torch.dtype, device: torch.device, quantization: str | None = None
) -> LoadedModel:
    """Builds the model; `quantization` ("int8" / "int4") swaps its linear layers for weight-only
    quantized ones (CPU float32 kernels; the reference elsewhere)."""
    from plait.kernels.quant_matmul import QuantizedWeight
    from plait.runtime.tokenizer import Tokenizer

    location = locate_checkpoint(model_path)
    if location.kind == "gguf":
        from plait.runtime.model_loader.gguf_loader import iter_gguf_weights, open_gguf

        reader, meta, args = open_gguf(location.path)
        tokenizer = Tokenizer.from_gguf_metadata(meta)
        named = iter_gguf_weights(reader, args, keep_blocks=quantization is not None)
    else:
        from plait.runtime.model_loader.hf_loader import has_lm_head, iter_hf_weights, open_hf_dir

        _, args = open_hf_dir(location.path)
        if not args.tie_word_embeddings and not has_lm_head(location.path):
            args = replace(args, tie_word_embeddings=True)
        tokenizer = Tokenizer.from_hf_dir(location.path)
        named = iter_hf_weights(location.path)
    state = fuse_hf_weights(named, args, dtype)
    prequantized = {n: w for n, w in state.items() if isinstance(w, QuantizedWeight)}
    state = {n: w for n, w in state.items() if n not in prequantized}
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if m not in prequantized]
    missing = [m for m in missing if not (args.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {location.path}: missing weights {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(args)
    for name in prequantized:  # placeholders on the meta device until the swap below
        module = model.get_submodule(name.rsplit(".", 1)[0])
        module.weight = torch.nn.Parameter(torch.empty(module.weight.shape), requires_grad=False)
    if quantization is not None:
        from plait.runtime.models.quantized import quantize_linears

        quantize_linears(model, quantization, prequantized)
    model = model.to(device).eval()
    return LoadedModel(model=model, args=args, tokenizer=tokenizer, location=location)
