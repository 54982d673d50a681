"""Paged attention on the CPU with the native row kernel (`csrc/cpu_attention.cpp`).

Decode tokens and short extends (speculative verification, jump-forward and other few-token
extensions of a cached prefix) become *rows*: one query token over its request's slots, read in
place through a slot table, with no gather copy of the context. Long extends (prefill chunks)
stay on `scaled_dot_product_attention`, whose blocked matmuls win once a sequence brings many
query tokens.

The rows are built once per forward (`cpu_rows`, cached on the `AttentionMetadata`) and reused by
every layer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from functools import cache

import torch

from plait.kernels import native
from plait.kernels.attention import AttentionMetadata, KVScales, TorchAttention
from plait.kernels.kv_cache import flat_scales, kv_type_code
from plait.kernels.tuning import MAX_ROW_EXTEND


@dataclass
class CpuRows:
    tables: torch.Tensor  # [num_tables, width] long: slots
    q_index: torch.Tensor  # [R] long: row of the flat batch
    table_index: torch.Tensor  # [R] long
    first: torch.Tensor  # [R] long: first attended position (sliding window), else 0
    kv_len: torch.Tensor  # [R] long: attend positions [first, kv_len)
    row_extends: frozenset[int]  # extend entries handled as rows
    window: int | None = None  # the sliding window `first` was computed for
    invariant: bool = False  # each row split by its own length alone (`AttentionMetadata`)

    def for_window(self, window: int | None) -> CpuRows:
        """The same rows seen through another sliding window (a model whose layers differ)."""
        if window == self.window:
            return self
        first = (
            torch.zeros_like(self.kv_len)
            if window is None
            else (self.kv_len - window).clamp_(min=0)
        )
        return replace(self, first=first, window=window)


@cache
def _kernel() -> ctypes._CFuncPtr | None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    argtypes = (
        [ptr] * 5
        + [ctypes.c_int, ptr, i64]
        + [ptr] * 5
        + [i64] * 4
        + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    )
    return native.function("cpu_kernels", "plait_paged_attention_rows", argtypes)


def native_attention_available() -> bool:
    return _kernel() is not None


def use_native_attention(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """CPU float32 queries over a float32, bfloat16 or int8 cache, and the native kernels built
    (see `kernels/native.py`)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and kv_type_code(k_cache.dtype) is not None
        and not native.native_disabled()
        and native_attention_available()
    )


def cpu_rows(meta: AttentionMetadata, sliding_window: int | None) -> CpuRows:
    """The rows of a forward: every decode token, and each token of the short extends (of every
    extend where the layout is batch-invariant)."""
    if (
        not meta.extend_q_lens and meta.decode_kv_slots is not None
    ):  # decodes only: their tables as built
        lens = meta.decode_kv_lens.to(torch.long)
        rows = torch.arange(meta.num_decode)
        first = (
            torch.zeros_like(lens)
            if sliding_window is None
            else (lens - sliding_window).clamp_(min=0)
        )
        return CpuRows(
            meta.decode_kv_slots,
            rows,
            rows,
            first,
            lens,
            frozenset(),
            sliding_window,
            meta.batch_invariant,
        )
    tables: list[torch.Tensor] = []
    q_index: list[int] = []
    table_index: list[int] = []
    kv_len: list[int] = []
    row_extends = []
    for i, (start, q_len, total, slots) in enumerate(
        zip(meta.extend_q_starts, meta.extend_q_lens, meta.extend_kv_lens, meta.extend_kv_slots)
    ):
        if q_len > MAX_ROW_EXTEND and not meta.batch_invariant:
            continue
        row_extends.append(i)
        prefix = total - q_len
        for j in range(q_len):
            q_index.append(start + j)
            table_index.append(len(tables))
            kv_len.append(prefix + j + 1)
        tables.append(slots)
    width = max((t.shape[0] for t in tables), default=0)
    num_ext_tables = len(tables)
    if meta.decode_kv_slots is not None:
        width = max(width, meta.decode_kv_slots.shape[1])
    table = torch.zeros(num_ext_tables + meta.num_decode, width, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, : t.shape[0]] = t
    lens = torch.tensor(kv_len, dtype=torch.long)
    qi = torch.tensor(q_index, dtype=torch.long)
    ti = torch.tensor(table_index, dtype=torch.long)
    if meta.decode_kv_slots is not None:
        b = meta.num_decode
        table[num_ext_tables:, : meta.decode_kv_slots.shape[1]] = meta.decode_kv_slots
        first_decode = meta.num_extend_tokens
        qi = torch.cat([qi, torch.arange(first_decode, first_decode + b)])
        ti = torch.cat([ti, torch.arange(num_ext_tables, num_ext_tables + b)])
        lens = torch.cat([lens, meta.decode_kv_lens.to(torch.long)])
    first = torch.zeros_like(lens)
    if sliding_window is not None:
        first = (lens - sliding_window).clamp_(min=0)
    return CpuRows(
        table, qi, ti, first, lens, frozenset(row_extends), sliding_window, meta.batch_invariant
    )


def attention_rows(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    rows: CpuRows,
    out: torch.Tensor,
    scale: float,
    kv_scales: KVScales = None,
) -> None:
    """out[q_index[r]] = attention of q[q_index[r]] over its slots, for every row r (in place)."""
    num_rows = rows.q_index.shape[0]
    if num_rows == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_flat.shape[1]
    assert (
        q.is_contiguous()
        and out.is_contiguous()
        and k_flat.is_contiguous()
        and v_flat.is_contiguous()
    )
    ks, vs = flat_scales(kv_scales) or (None, None)
    _kernel()(
        q.data_ptr(),
        k_flat.data_ptr(),
        v_flat.data_ptr(),
        None if ks is None else ks.data_ptr(),
        None if vs is None else vs.data_ptr(),
        kv_type_code(k_flat.dtype),
        rows.tables.data_ptr(),
        rows.tables.shape[1],
        rows.q_index.data_ptr(),
        rows.table_index.data_ptr(),
        rows.first.data_ptr(),
        rows.kv_len.data_ptr(),
        out.data_ptr(),
        num_rows,
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        int(rows.invariant),
        torch.get_num_threads(),
    )


class NativeAttention(TorchAttention):
    """float32 CPU queries over a float32, bfloat16 or int8 cache (`use_native_attention`):
    decode tokens and short extends as rows over slot tables (`attention_rows`), long extends by
    the extend kernel chosen for the activations."""

    name = "native"

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: KVScales = None,
    ) -> torch.Tensor:
        k_flat, v_flat = self.store(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        if meta.cpu is None:
            meta.cpu = cpu_rows(meta, sliding_window)
        rows: CpuRows = meta.cpu.for_window(sliding_window)
        q = q.contiguous()
        out = torch.empty_like(q)
        self.attend_extends(
            q, k, v, k_flat, v_flat, meta, scale, sliding_window, out, rows.row_extends, kv_scales
        )
        attention_rows(q, k_flat, v_flat, rows, out, scale, kv_scales)
        return out


def paged_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: KVScales = None,
) -> torch.Tensor:
    """Same contract as `attention.paged_attention_ref` (`NativeAttention`, built here for q)."""
    backend = NativeAttention(q.device, q.dtype, q.shape[2])
    return backend.attend(q, k, v, k_cache, v_cache, meta, scale, sliding_window, kv_scales)
