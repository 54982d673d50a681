"""Reading a GGUF file: hyperparameters and tokenizer from its metadata; weights dequantized, or
kept in their blocks where plait's quantized kernels read them directly (Q4_1 and Q4_0 as int4,
Q8_0 as int8, all with groups of 32)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from plait.kernels.quant_matmul import QuantizedWeight
from plait.runtime.models.llama import LlamaArgs

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "mistral")
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_LAYER_NAMES = {
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
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def read_metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def args_from_metadata(meta: dict[str, Any]) -> LlamaArgs:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF: unsupported architecture {arch!r}; plait supports "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    rope_scaling = None
    if get("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    return LlamaArgs(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv") or num_heads,
        head_dim=get("attention.key_length") or hidden // num_heads,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings=False,
        attention_bias=arch == "qwen2",
        sliding_window=get("attention.sliding_window"),
        architecture={"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(
            arch, "LlamaForCausalLM"
        ),
    )


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-rope permutation of q/k rows (back to rotate-half order)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _dequantize(tensor: Any) -> np.ndarray:
    import gguf

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(
            f"GGUF: tensor {tensor.name} has type {kind}; plait dequantizes "
            f"{', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # rows first, as torch
    if kind == "F32":
        return np.asarray(tensor.data, dtype=np.float32).reshape(shape)
    if kind == "BF16":
        raw = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(shape)
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)


_BLOCK_TYPES = ("Q4_1", "Q4_0", "Q8_0")


def _quantized_blocks(tensor: Any) -> QuantizedWeight:
    """A Q4_1 / Q4_0 / Q8_0 matrix as a `QuantizedWeight`, its blocks copied, not re-quantized."""
    kind = tensor.tensor_type.name
    n, k = (int(d) for d in reversed(tensor.shape.tolist()))
    block_bytes = {"Q4_1": 20, "Q4_0": 18, "Q8_0": 34}[kind]
    raw = np.asarray(tensor.data).view(np.uint8).reshape(n, k // 32, block_bytes)
    scale = np.ascontiguousarray(raw[..., 0:2].copy().view(np.float16)[..., 0])  # float16, as the kernels read it
    if kind == "Q8_0":
        q = raw[..., 2:34].copy().view(np.int8).reshape(n, k)
        return QuantizedWeight("int8", torch.from_numpy(q), torch.from_numpy(scale), None, 32)
    if kind == "Q4_1":
        low = raw[..., 2:4].copy().view(np.float16)[..., 0]
        packed = raw[..., 4:20]
    else:  # Q4_0: w = (q - 8) * d, exact in float16 (a power-of-two multiple)
        low = (scale * np.float16(-8.0)).astype(np.float16)
        packed = raw[..., 2:18]
    return QuantizedWeight(
        "int4", torch.from_numpy(packed.reshape(n, k // 2).copy()), torch.from_numpy(scale),
        torch.from_numpy(np.ascontiguousarray(low, dtype=np.float16)), 32,
    )


def iter_gguf_weights(
    reader: Any, args: LlamaArgs, keep_blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yields (Hugging Face name, float32 tensor) for every tensor in the file.

    With `keep_blocks`, 2-D Q4_1 / Q4_0 / Q8_0 tensors come as `QuantizedWeight`s instead; the
    token embedding then comes twice, as float32 (the lookup table) and quantized (under
    `lm_head.weight` when the file has no separate output matrix).
    """
    permute = args.architecture != "Qwen2ForCausalLM"
    for tensor in reader.tensors:
        name = tensor.name
        if name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        elif name.startswith("blk."):
            _, layer, kind, leaf = name.split(".", 3)
            if kind not in _LAYER_NAMES:
                if kind in ("rope_freqs",):
                    continue
                raise ValueError(f"GGUF: unexpected tensor {name}")
            hf_name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{leaf}"
        elif name == "rope_freqs.weight":
            continue
        else:
            raise ValueError(f"GGUF: unexpected tensor {name}")
        if keep_blocks and tensor.tensor_type.name in _BLOCK_TYPES and len(tensor.shape) == 2:
            qw = _quantized_blocks(tensor)
            if permute and leaf_is_qk(name):
                heads = args.num_heads if ".attn_q." in name else args.num_kv_heads
                qw = qw.rows(torch.from_numpy(_unpermute(np.arange(qw.shape[0]), heads).copy()))
            if name != "token_embd.weight":
                yield hf_name, qw
                continue
            if args.tie_word_embeddings:
                yield "lm_head.weight", qw
        array = _dequantize(tensor)
        if permute and leaf_is_qk(name):
            heads = args.num_heads if ".attn_q." in name else args.num_kv_heads
            array = _unpermute(array, heads)
        yield hf_name, torch.from_numpy(np.array(array, dtype=np.float32, copy=True))


def leaf_is_qk(name: str) -> bool:
    return ".attn_q." in name or ".attn_k." in name


def open_gguf(path: str) -> tuple[Any, dict[str, Any], LlamaArgs]:
    import gguf

    reader = gguf.GGUFReader(path)
    meta = read_metadata(reader)
    args = args_from_metadata(meta)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    if not has_output:
        from dataclasses import replace

        args = replace(args, tie_word_embeddings=True)
    return reader, meta, args
