"""Decode steps of a Llama-family model on the CPU through the native layer stack.

When every projection is a `QuantLinear` or a float32 `nn.Linear` and the native kernels are
built, the engine's `Execution` (`runtime/execution.py`) holds one `NativeDecodeStack`, built at
start: the layer descriptions (pointers to weights and KV pages). For a small step (decode tokens
and short extends, all of them attention rows) the runner hands it to `LlamaModel.forward` in the
`ForwardBatch`, which runs the layers through `kernels/decode_stack.py` in one call instead of
~10 per layer.

`NativeDecodeStack.burst` runs several whole decode steps (embedding to the argmax or a draw) in one
native call, for the engine's continuous decode steps.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from plait.kernels import decode_stack
from plait.kernels.kv_cache import kv_type_code
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.kv_pool import KVPool
from plait.runtime.models.quantized import QuantLinear

if TYPE_CHECKING:
    from plait.runtime.models.llama import LlamaForCausalLM, LlamaModel


class NativeDecodeStack:
    def __init__(self, model: LlamaModel, pool: KVPool) -> None:
        first = model.layers[0]
        attn, mlp = first.self_attn, first.mlp
        self.kv_pool = pool
        self.sliding_window = attn.sliding_window
        self.layers = (decode_stack.DecodeLayer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            k_cache, v_cache = pool.layer(i)
            scales = pool.scales(i) or (None, None)
            self.layers[i] = decode_stack.DecodeLayer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                *(_linear(p) for p in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                *(None if s is None else s.data_ptr() for s in scales),
            )
        self.shape = decode_stack.DecodeShape(
            0,
            model.embed_tokens.weight.shape[1],
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            mlp.intermediate_size,
            first.input_layernorm.eps,
            attn.scale,
            kv_type_code(pool.dtype),
            pool.layer(0)[0].numel() // (attn.num_kv_heads * attn.head_dim),
        )
        self.scratch = torch.empty(0)

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        batch: ForwardBatch,
        num_layers: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it), as the layers return."""
        meta = batch.attn
        assert meta.cpu is not None, "the runner builds the CPU attention rows of a native step"
        tokens = x.shape[0]
        self.shape.tokens = tokens
        need = decode_stack.scratch_floats(tokens, self.shape)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need)
        x = x.contiguous()  # the embedding lookup's own copy, updated in place
        residual = torch.empty_like(x)
        decode_stack.run_layers(
            self.layers,
            num_layers,
            self.shape,
            meta.cpu,
            positions.contiguous(),
            inv_freq,
            meta.slot_mapping.contiguous(),
            x,
            residual,
            False,
            self.scratch,
        )
        return x, residual

    def burst(
        self,
        lm: LlamaForCausalLM,
        ids: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        steps: int,
        stop_ids: list[list[int]],
        interrupt: ctypes.c_int32 | None = None,
        sampling: decode_stack.BurstSampling | None = None,
        out: torch.Tensor | None = None,
        masks: decode_stack.BurstMasks | None = None,
    ) -> torch.Tensor:
        """Up to `steps` steps from `ids` [B] (see `ModelRunner.decode_burst`), greedy unless
        `sampling` says otherwise, among the tokens `masks` allows; `interrupt`, an int32 another
        thread may set non-zero, ends the burst after the current step; `out` [B, steps], if
        given, is filled step by step (`masks` reads it)."""
        model = lm.model
        rows = ids.shape[0]
        self.shape.tokens = rows
        vocab = lm.lm_head.out_features
        need = decode_stack.burst_scratch_floats(rows, self.shape, vocab)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need)
        offsets = [0]
        for stops in stop_ids:
            offsets.append(offsets[-1] + len(stops))
        flat_stops = torch.tensor([t for stops in stop_ids for t in stops] or [0], dtype=torch.long)
        offsets_t = torch.tensor(offsets, dtype=torch.long)
        tables, lens = tables.contiguous(), lens.contiguous()
        embed = model.embed_tokens.weight
        burst = decode_stack.DecodeBurst(
            embed.data_ptr(),
            embed.shape[0],
            model.norm.weight.data_ptr(),
            _linear(lm.lm_head),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            flat_stops.data_ptr(),
            offsets_t.data_ptr(),
            self.sliding_window or 0,
            None if interrupt is None else ctypes.addressof(interrupt),
            *(sampling.pointers(rows, steps) if sampling is not None else (None,) * 5),
            *(masks.pointers(rows) if masks is not None else (None, None, None, 0)),
        )
        return decode_stack.run_burst(
            self.layers,
            len(model.layers),
            self.shape,
            burst,
            ids.contiguous(),
            steps,
            model.rotary_emb.inv_freq,
            self.scratch,
            out,
        )


def _linear(layer: torch.nn.Module) -> decode_stack.QLinear:
    if isinstance(layer, QuantLinear):
        return decode_stack.qlinear(layer.qw, layer.bias)
    return decode_stack.dense_linear(layer.weight, layer.bias)


def usable_linear(layer: torch.nn.Module) -> bool:
    if isinstance(layer, QuantLinear):
        return True
    w = layer.weight if type(layer) is torch.nn.Linear else None
    return (
        w is not None and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
    )


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the native stack cannot run `model`'s layers, or None where it can. The stack runs the
    Llama decoder layer: RMSNorm, qkv (with bias), rotary, paged attention with one sliding window
    for all layers, o, RMSNorm, SiLU-gated MLP."""
    from plait.runtime.models.llama import DecoderLayer

    args = getattr(model, "args", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if args is None or layers is None or not all(type(layer) is DecoderLayer for layer in layers):
        return f"the {getattr(args, 'family', type(model).__name__)} decoder layer"
    if args.num_experts:
        return "mixture-of-experts MLP"
    if args.qk_norm:
        return "q/k norms"
    if args.activation != "silu":
        return f"{args.activation} activation"
    if not args.uniform_layers:
        return "layers with different windows or rope bases"
    if args.embed_scale is not None:
        return "scaled embeddings"
    if args.head_dim > 1024:
        return f"head_dim {args.head_dim}"
    if not all(
        usable_linear(p)
        for layer in layers
        for p in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ):
        return "projections that are neither quantized nor contiguous float32 on the CPU"
    return None
