"""The cache side of paged attention in Triton: the page tables the kernels read
(`PagedAttentionTables`, derived from the reference's `AttentionMetadata`), the KV store, and the
helpers the decode and extend kernels share.

Cache layout per layer: K and V `[num_pages, page_size, num_kv_heads, head_dim]`, contiguous;
slot = page * page_size + offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import torch

from plait.kernels.dispatch import is_interpreted, launch
from plait.kernels.tuning import DECODE_MAX_SPLITS, DECODE_SPLIT_MIN_TOKENS, DECODE_SPLIT_OCCUPANCY

if TYPE_CHECKING:
    from plait.kernels.attention import AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # Linux-only wheels; the torch reference needs nothing else
    triton = None

LOG2E = 1.4426950408889634


@dataclass
class PagedAttentionTables:
    """What the GPU kernels need per forward, built once and shared by every layer."""

    page_size: int
    num_extend_tokens: int = 0
    extend_page_table: torch.Tensor | None = None  # [E, max_pages] int32
    extend_q_starts: torch.Tensor | None = None  # [E] int32: first row in the flat batch
    extend_q_lens: torch.Tensor | None = None  # [E] int32
    extend_kv_lens: torch.Tensor | None = None  # [E] int32: cached prefix + new tokens
    max_extend_q_len: int = 0
    extend_cu_seqlens: torch.Tensor | None = None  # [E + 1] int32, for flash-attn
    extends_have_no_prefix: bool = False  # every extend starts at position 0 (flash-attn applies)
    decode_page_table: torch.Tensor | None = None  # [B, max_pages] int32
    decode_kv_lens: torch.Tensor | None = None  # [B] int32
    num_kv_splits: int = 1  # decode split-K; keep fixed per batch size so CUDA graphs replay


@cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_kv_splits(
    batch: int, num_kv_heads: int, max_kv_len: int, device: torch.device
) -> int:
    """Enough (batch, kv head, split) programs to fill the GPU twice, at least 256 tokens each
    (`kernels/tuning.py`: DECODE_SPLIT_*)."""
    by_length = math.ceil(max_kv_len / DECODE_SPLIT_MIN_TOKENS)
    by_occupancy = math.ceil(
        DECODE_SPLIT_OCCUPANCY * _num_sms(device) / max(batch * num_kv_heads, 1)
    )
    return max(1, min(by_length, by_occupancy, DECODE_MAX_SPLITS))


def triton_metadata_from(
    meta: AttentionMetadata, page_size: int, num_kv_heads: int, num_kv_splits: int | None = None
) -> PagedAttentionTables:
    """Page tables from the reference metadata's slot tensors (device ops only, no host sync).

    Relies on the model runner's layout: position p of a request lives at
    `pages[p // page_size] * page_size + p % page_size`, so every page's first slot is page-aligned.
    """
    device = meta.slot_mapping.device
    tables = PagedAttentionTables(page_size=page_size, num_extend_tokens=meta.num_extend_tokens)
    if meta.extend_q_lens:
        num_pages = [math.ceil(n / page_size) for n in meta.extend_kv_lens]
        table = torch.zeros(len(num_pages), max(num_pages), dtype=torch.int32, device=device)
        for i, slots in enumerate(meta.extend_kv_slots):
            table[i, : num_pages[i]] = slots[::page_size] // page_size
        cu = [0]
        for n in meta.extend_q_lens:
            cu.append(cu[-1] + n)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        tables.extend_page_table = table
        tables.extend_q_starts = as_tensor(meta.extend_q_starts)
        tables.extend_q_lens = as_tensor(meta.extend_q_lens)
        tables.extend_kv_lens = as_tensor(meta.extend_kv_lens)
        tables.max_extend_q_len = max(meta.extend_q_lens)
        tables.extend_cu_seqlens = as_tensor(cu)
        tables.extends_have_no_prefix = meta.extend_q_lens == meta.extend_kv_lens and (
            meta.extend_q_starts == cu[:-1]
        )
    if meta.decode_kv_slots is not None:
        batch, width = meta.decode_kv_slots.shape
        tables.decode_page_table = (meta.decode_kv_slots[:, ::page_size] // page_size).to(
            torch.int32
        )
        tables.decode_kv_lens = meta.decode_kv_lens.to(torch.int32)
        tables.num_kv_splits = num_kv_splits or choose_num_kv_splits(
            batch, num_kv_heads, width, device
        )
    return tables


def tables_from_pages(
    page_size: int,
    num_kv_heads: int,
    device: torch.device | str,
    extend_pages: list[list[int]] = (),
    extend_q_lens: list[int] = (),
    extend_kv_lens: list[int] = (),
    decode_pages: list[list[int]] = (),
    decode_kv_lens: list[int] = (),
    num_kv_splits: int | None = None,
    decode_width: int | None = None,
) -> PagedAttentionTables:
    """The same tables straight from the requests' page lists (host ints, one copy per tensor):
    cheaper than `triton_metadata_from` for long contexts, since no per-token slot tensor is built.
    Extend rows are packed in order from row 0; `decode_width` pads the decode page table to a
    fixed number of pages (CUDA graphs replay fixed shapes)."""

    def padded(tables: list[list[int]], width: int) -> torch.Tensor:
        rows = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)

    def ints(xs: list[int]) -> torch.Tensor:
        return torch.tensor(list(xs), dtype=torch.int32).to(device, non_blocking=True)

    tables = PagedAttentionTables(page_size=page_size, num_extend_tokens=sum(extend_q_lens))
    if extend_q_lens:
        needed = [math.ceil(n / page_size) for n in extend_kv_lens]
        starts = [sum(extend_q_lens[:i]) for i in range(len(extend_q_lens))]
        tables.extend_page_table = padded(
            [p[:n] for p, n in zip(extend_pages, needed)], max(needed)
        )
        tables.extend_q_starts = ints(starts)
        tables.extend_q_lens = ints(extend_q_lens)
        tables.extend_kv_lens = ints(extend_kv_lens)
        tables.max_extend_q_len = max(extend_q_lens)
        tables.extend_cu_seqlens = ints([*starts, tables.num_extend_tokens])
        tables.extends_have_no_prefix = list(extend_q_lens) == list(extend_kv_lens)
    if decode_kv_lens:
        needed = [math.ceil(n / page_size) for n in decode_kv_lens]
        width = decode_width or max(needed)
        tables.decode_page_table = padded([p[:n] for p, n in zip(decode_pages, needed)], width)
        tables.decode_kv_lens = ints(decode_kv_lens)
        tables.num_kv_splits = num_kv_splits or choose_num_kv_splits(
            len(decode_kv_lens), num_kv_heads, max(decode_kv_lens), torch.device(device)
        )
    return tables


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "attention_triton: k_cache and v_cache must be [pages, page_size, kv_heads, head_dim]"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("attention_triton: the KV cache must be contiguous")


def dot_options(q: torch.Tensor) -> dict[str, object]:
    # NOTE: Triton's interpreter computes bf16 `tl.dot` wrongly, so on CPU both operands go to
    # float32 first (the same products the GPU's bf16 tensor cores accumulate in float32).
    return {
        "UPCAST": is_interpreted(q),
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        k_ptr,
        v_ptr,
        k_cache,
        v_cache,
        slots_ptr,
        k_stride_t,
        k_stride_h,
        v_stride_t,
        v_stride_h,
        cache_stride_slot,
        HEAD_DIM: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # grid: (tokens,); one program copies one token's [num_kv_heads, head_dim] K and V
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < NUM_KV_HEADS * HEAD_DIM
        h, d = offs // HEAD_DIM, offs % HEAD_DIM
        k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d, mask=mask)
        v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
        tl.store(k_cache + slot * cache_stride_slot + offs, k, mask=mask)
        tl.store(v_cache + slot * cache_stride_slot + offs, v, mask=mask)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Same contract as `attention.write_kv`: k, v [T, Hkv, D] go to cache slots [T]."""
    check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("store_kv_triton: head_dim must be contiguous in k and v")
    launch(
        _store_kv_kernel,
        (num_tokens,),
        k,
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        HEAD_DIM=head_dim,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
        num_warps=4,
    )
