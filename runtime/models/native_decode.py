"""Decode steps of a model on the CPU through the native layer stack.

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
from plait.runtime.models.moe import ExpertWeights, SparseMoE
from plait.runtime.models.quantized import QuantEmbedding, QuantExpertWeights, QuantLinear

if TYPE_CHECKING:
    from plait.runtime.models.llama import LlamaForCausalLM


class NativeDecodeStack:
    def __init__(self, lm: LlamaForCausalLM, pool: KVPool, batch_invariant: bool = False) -> None:
        """`batch_invariant`: each row's linears and attention as that row alone gets them (the
        engine's `deterministic` mode, `kernels/batch_invariant.py`)."""
        model, args = lm.model, lm.args
        first = model.layers[0]
        attn = first.self_attn
        self.kv_pool = pool
        # the page spaces a step lays out (`ModelRunner`): the pool's pages alone, or the window
        # pages alone where every layer slides, or both, the sliding layers in the second
        self.mixed = pool.has_window_layers and not all(pool.window_layers)
        self.space_of = [int(self.mixed and w) for w in pool.window_layers]
        self.spaces = 1 + self.mixed
        self.window = args.sliding_window  # of the sliding layers
        # the slots of each space's pages (0: a space no layer uses)
        self.num_slots = [0, 0]
        for i, space in enumerate(self.space_of):
            k = pool.layer(i)[0]
            self.num_slots[space] = k.numel() // (args.num_kv_heads * args.head_dim)
        # the layers' rotary frequencies, kept alive here: the layers hold pointers to them
        self.inv_freqs = [_inv_freq(model, layer) for layer in model.layers]
        self._kept: list[object] = []  # the mixtures' descriptions, which the layers point to
        self.layers = (decode_stack.DecodeLayer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            k_cache, v_cache = pool.layer(i)
            scales = pool.scales(i) or (None, None)
            pre_mlp = getattr(layer, "pre_feedforward_layernorm", None)
            self.layers[i] = decode_stack.DecodeLayer(
                layer.input_layernorm.weight.data_ptr(),
                # the norm before the MLP: Gemma's pre-feedforward one; the Llama layer's second
                (pre_mlp or layer.post_attention_layernorm).weight.data_ptr(),
                *(_weight(n) for n in (a.q_norm, a.k_norm)),
                # Gemma's norms on the attention's and the MLP's outputs
                _weight(layer.post_attention_layernorm if pre_mlp is not None else None),
                _weight(getattr(layer, "post_feedforward_layernorm", None)),
                self.inv_freqs[i].data_ptr(),
                _linear(a.qkv_proj),
                _linear(a.o_proj),
                *(
                    (decode_stack.QLinear(), decode_stack.QLinear())
                    if isinstance(m, SparseMoE)
                    else (_linear(m.gate_up_proj), _linear(m.down_proj))
                ),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                *(None if s is None else s.data_ptr() for s in scales),
                k_cache.numel() // (attn.num_kv_heads * attn.head_dim),
                self.space_of[i],
                self._mixture(m) if isinstance(m, SparseMoE) else None,
            )
        self.shape = decode_stack.DecodeShape(
            0,
            args.hidden_size,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            args.intermediate_size,  # the dense MLP's (a mixture sizes its own buffers)
            first.input_layernorm.eps,
            attn.scale,
            kv_type_code(pool.dtype),
            decode_stack.ACTIVATION_CODE[args.activation],
            int(batch_invariant),
        )
        self.scratch = torch.empty(0)

    def _mixture(self, moe: SparseMoE) -> ctypes._Pointer:
        """The mixture's description; it and its arrays are kept alive by the stack."""
        experts = moe.experts
        gate_up = (decode_stack.QLinear * experts.num_experts)(
            *(_expert_linear(experts.gate_up_proj, e) for e in range(experts.num_experts))
        )
        down = (decode_stack.QLinear * experts.num_experts)(
            *(_expert_linear(experts.down_proj, e) for e in range(experts.num_experts))
        )
        described = decode_stack.MoE(
            _linear(moe.gate),
            gate_up,
            down,
            experts.num_experts,
            moe.top_k,
            experts.intermediate_size,
            int(moe.norm_topk_prob),
        )
        self._kept += [gate_up, down, described]
        return ctypes.pointer(described)

    def forward_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        num_layers: int | None,
        norm: torch.nn.Module,
    ) -> torch.Tensor:
        """The model's hidden states after its first `num_layers` layers (None: all) and its final
        `norm`, from the (scaled) embeddings x [T, hidden]: a model's forward on the stack."""
        count = len(self.layers) if num_layers is None else min(num_layers, len(self.layers))
        x, residual = self.run(x, positions, batch, count)
        return norm(x, residual, ops=batch.ops)[0]

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        num_layers: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it), as the layers return."""
        metas = [batch.attn] + ([batch.attn_window] if self.mixed else [])
        assert all(m is not None and m.cpu is not None for m in metas), (
            "the runner builds the CPU attention rows of a native step"
        )
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
            [m.cpu for m in metas],
            positions.contiguous(),
            torch.stack([m.slot_mapping for m in metas]),
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
        tables: list[torch.Tensor],
        lens: torch.Tensor,
        steps: int,
        stop_ids: list[list[int]],
        interrupt: ctypes.c_int32 | None = None,
        sampling: decode_stack.BurstSampling | None = None,
        out: torch.Tensor | None = None,
        masks: decode_stack.BurstMasks | None = None,
    ) -> torch.Tensor:
        """Up to `steps` steps from `ids` [B] (see `BurstRunner.run`), greedy unless
        `sampling` says otherwise, among the tokens `masks` allows; `tables`: each row's slots in
        each page space the layers use (`spaces`); `interrupt`, an int32 another thread may set
        non-zero, ends the burst after the current step; `out` [B, steps], if given, is filled
        step by step (`masks` reads it)."""
        model, args = lm.model, lm.args
        rows = ids.shape[0]
        if len(tables) != self.spaces:
            raise ValueError(f"tables: one per page space ({self.spaces}), got {len(tables)}")
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
        tables = [t.contiguous() for t in tables]
        lens = lens.contiguous()
        embed, blocks, row_bytes = _embedding(model.embed_tokens)
        windows = [args.layer_window(0) if not self.mixed else None, self.window]
        burst = decode_stack.DecodeBurst(
            embed,
            model.embed_tokens.num_embeddings,
            blocks,
            row_bytes,
            args.embed_scale or 1.0,
            args.final_logit_softcap or 0.0,
            model.norm.weight.data_ptr(),
            _linear(lm.lm_head),
            (ctypes.c_void_p * 2)(*(t.data_ptr() for t in tables)),
            (ctypes.c_int64 * 2)(*self.num_slots),
            (ctypes.c_int64 * 2)(*(w or 0 for w in windows)),
            tables[0].shape[1],
            lens.data_ptr(),
            flat_stops.data_ptr(),
            offsets_t.data_ptr(),
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
            self.scratch,
            out,
        )


def _expert_linear(projection: torch.nn.Module, expert: int) -> decode_stack.QLinear:
    """One expert's projection: its own `QuantLinear`, or its slice of the float32 stack."""
    if isinstance(projection, QuantExpertWeights):
        return _linear(projection.experts[expert])
    return decode_stack.dense_linear(projection.weight[expert], None)


def _weight(norm: torch.nn.Module | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _inv_freq(model: torch.nn.Module, layer: torch.nn.Module) -> torch.Tensor:
    """The rotary frequencies a layer rotates with: the sliding layers' own where the family
    gives them another base (Gemma 3's `local_rotary_emb`), the model's otherwise."""
    local = getattr(model, "local_rotary_emb", None)
    if local is not None and layer.self_attn.sliding_window is not None:
        return local.inv_freq.contiguous()
    return model.rotary_emb.inv_freq.contiguous()


def _embedding(embed: torch.nn.Module) -> tuple[int | None, decode_stack.QLinear, tuple[int, ...]]:
    """(a float32 table's pointer, or None and the quantized blocks its rows are read from, with
    the bytes from one row of their qweight, scales and mins to the next)."""
    if isinstance(embed, QuantEmbedding):
        qw = embed.heads[0].qw
        parts = (qw.qweight, qw.scales, qw.mins)
        row_bytes = tuple(0 if t is None else t.stride(0) * t.element_size() for t in parts)
        return None, decode_stack.qlinear(qw, None), row_bytes
    return embed.weight.data_ptr(), decode_stack.QLinear(), (0, 0, 0)


def _linear(layer: torch.nn.Module) -> decode_stack.QLinear:
    if isinstance(layer, QuantLinear):
        return decode_stack.qlinear(layer.qw, layer.bias)
    return decode_stack.dense_linear(layer.weight, layer.bias)


def _float32_cpu(w: torch.Tensor | None) -> bool:
    return (
        w is not None and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
    )


def usable_embedding(embed: torch.nn.Module) -> bool:
    """A table the burst reads rows of: float32 and contiguous, or a tied head's blocks."""
    return isinstance(embed, QuantEmbedding) or _float32_cpu(getattr(embed, "weight", None))


def usable_linear(layer: torch.nn.Module) -> bool:
    """A projection the stack runs: quantized, or float32 on the CPU (a plain linear, or every
    expert's stacked weight)."""
    if isinstance(layer, QuantLinear):
        return True
    return type(layer) in (torch.nn.Linear, ExpertWeights) and _float32_cpu(layer.weight)


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the native stack cannot run `model`'s layers, or None where it can. The stack runs the
    Llama decoder layer (RMSNorm, qkv with bias, rotary, paged attention, o, RMSNorm, SiLU-gated
    MLP) and Gemma 3's (norms on the attention's and the MLP's outputs too, GELU-tanh), with q/k
    norms, each layer's own rotary base and window, scaled embeddings, and a mixture of experts
    in place of the MLP."""
    from plait.runtime.models.gemma3 import Gemma3DecoderLayer
    from plait.runtime.models.llama import DecoderLayer

    args = getattr(model, "args", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if args is None or layers is None:
        return f"the {type(model).__name__} model"
    if not all(type(layer) in (DecoderLayer, Gemma3DecoderLayer) for layer in layers):
        return f"the {args.family} decoder layer"
    if args.activation not in decode_stack.ACTIVATION_CODE:
        return f"{args.activation} activation"
    if args.head_dim > 1024 or args.head_dim % 2:
        return f"head_dim {args.head_dim}"
    if not all(usable_linear(p) for layer in layers for p in _projections(layer)):
        return "projections that are neither quantized nor contiguous float32 on the CPU"
    return None


def _projections(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The linears a layer's step runs (a mixture's router and every expert's projections)."""
    a, m = layer.self_attn, layer.mlp
    if not isinstance(m, SparseMoE):
        return [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]
    experts = []
    for projection in (m.experts.gate_up_proj, m.experts.down_proj):
        quantized = isinstance(projection, QuantExpertWeights)
        experts += list(projection.experts) if quantized else [projection]
    return [a.qkv_proj, a.o_proj, m.gate, *experts]
