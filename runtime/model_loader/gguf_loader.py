"""Reading a GGUF file: the family, hyperparameters and tokenizer from its metadata; weights
dequantized as the `gguf` package does (every type it reads, bit for bit), or kept in their blocks
where plait's quantized kernels read them directly (Q4_0, Q4_1, Q8_0, Q5_0 and the k-quants Q4_K,
Q5_K, Q6_K: `gguf_blocks.py`).

`open_gguf` reads only the header: it refuses a file that is not a GGUF, an architecture no
family runs, tensor types the `gguf` package cannot read and tensors the family does not have,
before any weight is touched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from plait.kernels.quant_weights import QuantizedWeight
from plait.runtime.model_loader.gguf_blocks import BLOCK_TYPES, quantized_blocks
from plait.runtime.model_loader.gguf_file import GgufFile, GgufTensor, dequantize
from plait.runtime.models.args import ModelArgs
from plait.runtime.models.registry import Family, family_for_gguf


@dataclass(frozen=True)
class GgufCheckpoint:
    path: str
    reader: GgufFile  # memory-mapped; tensors are read when iterated
    meta: dict[str, Any]
    family: Family
    args: ModelArgs

    def hf_names(self) -> list[str]:
        """The Hugging Face names of the file's weights (read from the header only)."""
        return [
            n
            for n in (self.family.gguf_to_hf(t.name) for t in self.reader.tensors)
            if n is not None
        ]


def readable_types() -> tuple[str, ...]:
    """The tensor types `gguf.quants.dequantize` reads (F32 and F16 are built in)."""
    from gguf import quants

    return ("F32", "F16", *sorted(t.name for t in quants._type_traits))  # its table of block types


def open_gguf(path: str) -> GgufCheckpoint:
    try:
        reader = GgufFile(path)
    except ValueError as exc:  # the magic, version and layout
        raise ValueError(f"model_path: {path} is not a GGUF file plait can read ({exc})") from None
    meta = reader.meta
    arch = meta.get("general.architecture")
    family = family_for_gguf(arch, f"GGUF {path}")
    readable = readable_types()
    unreadable: dict[str, str] = {}
    for t in reader.tensors:
        if t.tensor_type.name not in readable:
            unreadable.setdefault(t.tensor_type.name, t.name)
    if unreadable:
        listed = ", ".join(f"{kind} (e.g. {name})" for kind, name in unreadable.items())
        raise ValueError(
            f"GGUF {path}: architecture {arch!r} with tensors of types plait cannot read: "
            f"{listed}; "
            f"it reads {', '.join(readable)}"
        )
    try:
        names = {t.name: family.gguf_to_hf(t.name) for t in reader.tensors}
    except ValueError as exc:
        raise ValueError(f"GGUF {path}: {exc}") from None
    args = family.args_from_gguf(meta)
    if "lm_head.weight" not in names.values():
        args = replace(args, tie_word_embeddings=True)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3's rope scaling, one divisor per frequency
        args = replace(
            args, rope_freq_factors=tuple(float(f) for f in _dequantize(freqs).reshape(-1))
        )
    return GgufCheckpoint(path, reader, meta, family, args)


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-rope permutation of q/k rows (back to rotate-half order)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _dequantize(tensor: GgufTensor) -> np.ndarray:
    """The tensor as float32, rows first (as torch), exactly as `gguf.quants.dequantize` gives
    it."""
    return dequantize(tensor)


def _quantized_blocks(tensor: GgufTensor) -> QuantizedWeight | list[QuantizedWeight]:
    """A matrix of one of `BLOCK_TYPES` as a `QuantizedWeight`, its blocks copied, not
    re-quantized; a mixture of experts' stacked [E, n, k] tensor as one per expert."""
    *experts, n, k = tensor.dims
    qw = quantized_blocks(
        tensor.tensor_type.name, np.asarray(tensor.data), n * math.prod(experts), k
    )
    if not experts:
        return qw
    return [qw.rows(torch.arange(e * n, (e + 1) * n)) for e in range(experts[0])]


def iter_gguf_weights(
    ckpt: GgufCheckpoint,
    keep_blocks: bool = False,
    sources: list[tuple[str, str, bool]] | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yields (Hugging Face name, float32 tensor) for every weight in the file.

    With `keep_blocks`, 2-D tensors of `BLOCK_TYPES` come as `QuantizedWeight`s instead (3-D
    stacked experts as a list of them, one per expert); the
    token embedding then comes twice, as float32 (the lookup table) and quantized (under
    `lm_head.weight` when the file has no separate output matrix). `sources`, if given, gets
    (name, the file's type, kept in its blocks) for each weight yielded.
    """
    args, family = ckpt.args, ckpt.family
    record = sources.append if sources is not None else lambda item: None
    for tensor in ckpt.reader.tensors:
        name, kind = tensor.name, tensor.tensor_type.name
        hf_name = family.gguf_to_hf(name)
        if hf_name is None:
            continue
        heads = None
        if family.gguf_rope_permuted and (".attn_q." in name or ".attn_k." in name):
            heads = args.num_heads if ".attn_q." in name else args.num_kv_heads
        kept = keep_blocks and kind in BLOCK_TYPES and len(tensor.dims) in (2, 3)
        if kept:
            qw = _quantized_blocks(tensor)
            if heads is not None:
                qw = qw.rows(torch.from_numpy(_unpermute(np.arange(qw.shape[0]), heads).copy()))
            if name != "token_embd.weight":
                record((hf_name, kind, True))
                yield hf_name, qw
                continue
            if args.tie_word_embeddings:
                record(("lm_head.weight", kind, True))
                yield "lm_head.weight", qw
        try:
            array = _dequantize(tensor)
        except Exception as exc:  # noqa: BLE001 (the gguf package's own errors, whatever they are)
            raise ValueError(
                f"GGUF {ckpt.path}: tensor {name} ({kind}) could not be read: {exc}"
            ) from exc
        if heads is not None:
            array = _unpermute(array, heads)
        record((hf_name, kind, False))
        if name == "token_embd.weight" and args.tie_word_embeddings and not kept:
            record(("lm_head.weight", kind, False))
        if not array.flags.writeable:  # a view of the mapped file (F32)
            array = array.copy()
        yield hf_name, torch.from_numpy(array)
