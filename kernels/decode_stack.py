"""The decoder layers of a decode step in one native call (`csrc/cpu_decode.cpp`).

The caller (`runtime/models/native_decode.py`) describes each layer once, as pointers to its
norms (the Llama layer's two; q/k norms and output norms where the family has them), rotary
frequencies, quantized projections and KV pages (`DecodeLayer`); each step then passes the
shapes, the attention rows, positions and slots (per page space: the pool's pages and, for a
model with sliding and global layers, the sliding layers' window pages), and the hidden states,
which the kernel updates in place.
The structures mirror the C++ ones of `csrc/plait_kernels.h` field for field;
`tests/unit/test_native_abi.py` checks them against the sizes and offsets the library reports.

`run_burst` runs whole decode steps back to back in one call (embedding, layers, final norm, LM
head, then the argmax or, for sampled rows, the draw of `sampling_cpu`): the engine's continuous
decode steps (`num_continuous_decode_steps`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from plait.kernels import native
from plait.kernels.attention_cpu import CpuRows
from plait.kernels.kv_cache import slot_error
from plait.kernels.quant_weights import FORMAT_CODE, QuantizedWeight

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class QLinear(ctypes.Structure):
    _fields_ = [
        ("qweight", _p),
        ("scales", _p),
        ("mins", _p),
        ("bias", _p),
        ("out_features", _i64),
        ("in_features", _i64),
        ("group", _i64),
        ("format", _i64),
    ]


class MoE(ctypes.Structure):
    _fields_ = [
        ("router", QLinear),
        ("gate_up", ctypes.POINTER(QLinear)),
        ("down", ctypes.POINTER(QLinear)),
        ("num_experts", _i64),
        ("top_k", _i64),
        ("intermediate", _i64),
        ("normalize", _i64),
    ]


class DecodeLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p),
        ("post_norm", _p),
        ("q_norm", _p),
        ("k_norm", _p),
        ("attn_out_norm", _p),
        ("mlp_out_norm", _p),
        ("inv_freq", _p),
        ("qkv", QLinear),
        ("o", QLinear),
        ("gate_up", QLinear),
        ("down", QLinear),
        ("k_cache", _p),
        ("v_cache", _p),
        ("k_scale", _p),
        ("v_scale", _p),
        ("num_slots", _i64),
        ("space", _i64),
        ("moe", ctypes.POINTER(MoE)),
    ]


# the gated MLP's activation, by ModelArgs.activation (PlaitActivation)
ACTIVATION_CODE = {"silu": 0, "gelu_tanh": 1}


class DecodeShape(ctypes.Structure):
    _fields_ = [
        ("tokens", _i64),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("eps", _f32),
        ("attn_scale", _f32),
        ("kv_type", _i64),
        ("activation", _i64),
        ("invariant", _i64),  # 1: batch-invariant linears and attention (batch_invariant.py)
    ]


class DecodeRows(ctypes.Structure):
    _fields_ = [
        ("tables", _p),
        ("table_width", _i64),
        ("q_index", _p),
        ("table_index", _p),
        ("first", _p),
        ("kv_len", _p),
        ("num_rows", _i64),
    ]


class DecodeBurst(ctypes.Structure):
    _fields_ = [
        ("embed", _p),
        ("embed_rows", _i64),
        ("embed_blocks", QLinear),
        ("embed_row_bytes", _i64 * 3),
        ("embed_scale", _f32),
        ("logit_softcap", _f32),
        ("final_norm", _p),
        ("head", QLinear),
        ("tables", _p * 2),
        ("num_slots", _i64 * 2),
        ("sliding_window", _i64 * 2),
        ("table_width", _i64),
        ("lens", _p),
        ("stop_ids", _p),
        ("stop_offsets", _p),
        ("interrupt", _p),
        ("temperature", _p),
        ("top_k", _p),
        ("top_p", _p),
        ("min_p", _p),
        ("uniforms", _p),
        ("mask_fn", _p),
        ("bitmask", _p),
        ("masked", _p),
        ("mask_words", _i64),
    ]


@cache
def _kernel() -> ctypes._CFuncPtr | None:
    argtypes = [
        ctypes.POINTER(DecodeLayer),
        _i64,
        ctypes.POINTER(DecodeShape),
        ctypes.POINTER(DecodeRows),
        _p,
        _p,
        _p,
        _p,
        ctypes.c_int,
        _p,
        ctypes.c_int,
    ]
    return native.function("cpu_kernels", "plait_decode_layers", argtypes, restype=_i64)


@cache
def _burst_kernel() -> ctypes._CFuncPtr | None:
    argtypes = [
        ctypes.POINTER(DecodeLayer),
        _i64,
        ctypes.POINTER(DecodeShape),
        ctypes.POINTER(DecodeBurst),
        _p,
        _i64,
        _p,
        _p,
        _i64,
        ctypes.c_int,
    ]
    return native.function("cpu_kernels", "plait_decode_burst", argtypes, restype=_i64)


def available() -> bool:
    return not native.native_disabled() and _kernel() is not None


def burst_available() -> bool:
    return available() and _burst_kernel() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> QLinear:
    """A float32 [N, K] weight (the kernel's format 2)."""
    n, k = weight.shape
    return QLinear(weight.data_ptr(), None, None, _ptr(bias), n, k, k, FORMAT_CODE["float32"])


def qlinear(qw: QuantizedWeight, bias: torch.Tensor | None) -> QLinear:
    n, k = qw.shape
    return QLinear(
        _ptr(qw.qweight), _ptr(qw.scales), _ptr(qw.mins), _ptr(bias), n, k, qw.group, qw.code
    )


def scratch_floats(tokens: int, shape: DecodeShape) -> int:
    q = shape.num_heads * shape.head_dim
    qkv = q + 2 * shape.num_kv_heads * shape.head_dim
    return tokens * (shape.hidden + qkv + 2 * q + 3 * shape.intermediate)


def run_layers(
    layers: ctypes.Array,
    num_layers: int,
    shape: DecodeShape,
    rows: Sequence[CpuRows],
    positions: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    has_residual: bool,
    scratch: torch.Tensor,
) -> None:
    """Runs layers [0, num_layers) on x [T, hidden] in place; `residual` receives the stream.
    `rows` and `slots` (int64 [spaces, T]): the attention rows and KV slots of the tokens in each
    space a layer's `space` names (the pool's pages; the window pages, where some layers slide).
    A slot outside a layer's KV cache raises IndexError before any layer runs."""
    tokens = x.shape[0]
    assert (
        x.is_contiguous()
        and residual.is_contiguous()
        and scratch.numel() >= scratch_floats(tokens, shape)
        and slots.is_contiguous()
        and slots.shape == (len(rows), tokens)
    )
    tables = (DecodeRows * 2)(
        *(
            DecodeRows(
                r.tables.data_ptr(),
                r.tables.shape[1],
                r.q_index.data_ptr(),
                r.table_index.data_ptr(),
                r.first.data_ptr(),
                r.kv_len.data_ptr(),
                r.q_index.shape[0],
            )
            for r in rows
        )
    )
    bad = _kernel()(
        layers,
        num_layers,
        ctypes.byref(shape),
        tables,
        positions.data_ptr(),
        slots.data_ptr(),
        x.data_ptr(),
        residual.data_ptr(),
        int(has_residual),
        scratch.data_ptr(),
        torch.get_num_threads(),
    )
    if bad >= 0:
        layer = next(
            layers[i]
            for i in range(num_layers)
            if slots[layers[i].space, bad] >= layers[i].num_slots
        )
        raise slot_error(slots[layer.space], bad, layer.num_slots)


@dataclass
class BurstSampling:
    """The sampled rows of a burst: per row temperature (0: greedy), top_k (>= vocab: off), top_p,
    min_p, and uniforms [rows, steps] in [0, 1), row r's draw at step s being uniforms[r, s]."""

    temperature: torch.Tensor  # float32 [rows]
    top_k: torch.Tensor  # int64 [rows]
    top_p: torch.Tensor  # float32 [rows]
    min_p: torch.Tensor  # float32 [rows]
    uniforms: torch.Tensor  # float32 [rows, steps]

    def pointers(self, rows: int, steps: int) -> tuple[int, ...]:
        for name, dtype, shape in (
            ("temperature", torch.float32, (rows,)),
            ("top_k", torch.long, (rows,)),
            ("top_p", torch.float32, (rows,)),
            ("min_p", torch.float32, (rows,)),
            ("uniforms", torch.float32, (rows, steps)),
        ):
            t = getattr(self, name)
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(
                    f"{name}: expected contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}"
                )
        return tuple(
            getattr(self, n).data_ptr()
            for n in ("temperature", "top_k", "top_p", "min_p", "uniforms")
        )


MASK_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64)


@dataclass
class BurstMasks:
    """Grammar masks filled between a burst's steps. Before step s, the kernel calls `fill(s)`
    (a `MASK_FN`; the tokens of the steps before s are in the burst's `out` by then): non-zero
    ends the burst before step s; otherwise `fill` has set `masked[r]` non-zero for each row
    constrained at step s and written its allowed tokens into `bitmask[r]`
    (`kernels/constraint_mask.py`'s layout), which the step applies before it picks."""

    fill: ctypes._CFuncPtr  # MASK_FN: keep a reference for as long as the burst runs
    bitmask: torch.Tensor  # int32 [rows, words]
    masked: torch.Tensor  # int32 [rows]

    def pointers(self, rows: int) -> tuple[int, int, int, int]:
        for name, t in (("bitmask", self.bitmask), ("masked", self.masked)):
            if (
                t.dtype != torch.int32
                or t.shape[0] != rows
                or not t.is_contiguous()
                or t.device.type != "cpu"
            ):
                raise ValueError(f"{name}: expected a contiguous CPU int32 tensor of {rows} rows")
        fill = ctypes.cast(self.fill, ctypes.c_void_p).value
        return fill, self.bitmask.data_ptr(), self.masked.data_ptr(), self.bitmask.shape[1]


def burst_scratch_floats(rows: int, shape: DecodeShape, vocab: int) -> int:
    return scratch_floats(rows, shape) + rows * (3 * shape.hidden + vocab)


def run_burst(
    layers: ctypes.Array,
    num_layers: int,
    shape: DecodeShape,
    burst: DecodeBurst,
    ids: torch.Tensor,
    steps: int,
    scratch: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Up to `steps` decode steps for the rows of `ids` (int64 [B], the tokens fed first;
    `shape.tokens` must be B; sampled rows as `burst`'s sampling fields say, the others greedy).
    Returns the picked tokens, int64 [B, steps run]: fewer than `steps`
    when every row picked one of its stop ids or another thread set `burst.interrupt`. A row
    whose slots fall outside the pool or whose token is outside the embedding raises IndexError
    before any step runs. `out` (int64 [B, steps], contiguous), when given, receives the tokens
    as they are picked, a step's column after that step: another thread may read it meanwhile."""
    rows = ids.shape[0]
    assert shape.tokens == rows and ids.dtype == torch.long and ids.is_contiguous()
    assert scratch.numel() >= burst_scratch_floats(rows, shape, burst.head.out_features)
    if out is None:
        out = torch.empty(rows, steps, dtype=torch.long)
    assert out.shape == (rows, steps) and out.dtype == torch.long and out.is_contiguous()
    ran = _burst_kernel()(
        layers,
        num_layers,
        ctypes.byref(shape),
        ctypes.byref(burst),
        ids.data_ptr(),
        steps,
        out.data_ptr(),
        scratch.data_ptr(),
        scratch.numel(),
        torch.get_num_threads(),
    )
    if ran < 0:
        raise IndexError(
            f"decode burst: row {-1 - ran} has a slot outside the KV pool or a token outside the "
            "vocabulary"
        )
    return out[:, :ran]
