"""Extend (prefill) attention: a ragged batch of new tokens attending causally to their cached
prefix and themselves, read through page tables (Triton), or flash-attn's varlen kernel when no
sequence has a cached prefix."""

from __future__ import annotations

import torch

from plait.kernels.dispatch import flash_attn_varlen_func, launch
from plait.kernels.paged_kv_triton import LOG2E, PagedAttentionTables, check_cache, dot_options
from plait.kernels.tuning import EXTEND_BLOCK_M, EXTEND_BLOCK_N

try:
    import triton
    import triton.language as tl
except ImportError:  # Linux-only wheels; the torch reference needs nothing else
    triton = None


if triton is not None:

    @triton.jit
    def _extend_kernel(
        q_ptr,
        k_cache,
        v_cache,
        page_table,
        q_starts,
        q_lens,
        kv_lens,
        out_ptr,
        qk_scale,
        window,
        q_stride_t,
        q_stride_h,
        cache_stride_page,
        cache_stride_slot,
        cache_stride_head,
        table_stride,
        out_stride_t,
        out_stride_h,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        UPCAST: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # grid: (extend sequences, heads, query blocks); K/V of prefix and new tokens read via pages
        seq = tl.program_id(0)
        head = tl.program_id(1)
        block = tl.program_id(2)
        q_len = tl.load(q_lens + seq)
        if block * BLOCK_M < q_len:
            q_start = tl.load(q_starts + seq).to(tl.int64)
            kv_len = tl.load(kv_lens + seq)
            prefix = kv_len - q_len
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            d = tl.arange(0, BLOCK_D)
            q_mask = (rows[:, None] < q_len) & (d[None, :] < HEAD_DIM)
            q_ptrs = q_ptr + (q_start + rows)[:, None] * q_stride_t + head * q_stride_h + d[None, :]
            q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
            if UPCAST:
                q = q.to(tl.float32)
            q_pos = prefix + rows
            hi = tl.minimum(kv_len, prefix + (block + 1) * BLOCK_M)
            lo = 0
            if HAS_WINDOW:
                lo = tl.maximum(prefix + block * BLOCK_M - window + 1, 0)
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            head_offset = (head // GROUP) * cache_stride_head
            table = page_table + seq.to(tl.int64) * table_stride
            for n0 in range(lo, hi, BLOCK_N):
                pos = n0 + tl.arange(0, BLOCK_N)
                in_kv = pos < kv_len
                page = tl.load(table + pos // PAGE_SIZE, mask=in_kv, other=0)
                kv_rows = (
                    page.to(tl.int64) * cache_stride_page
                    + (pos % PAGE_SIZE) * cache_stride_slot
                    + head_offset
                )
                nd_mask = in_kv[:, None] & (d[None, :] < HEAD_DIM)
                k = tl.load(k_cache + kv_rows[:, None] + d[None, :], mask=nd_mask, other=0.0)
                v = tl.load(v_cache + kv_rows[:, None] + d[None, :], mask=nd_mask, other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                qk = (
                    tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
                )  # [BLOCK_M, BLOCK_N]
                attend = (pos[None, :] <= q_pos[:, None]) & in_kv[None, :]
                if HAS_WINDOW:
                    attend = attend & (pos[None, :] > q_pos[:, None] - window)
                qk = tl.where(attend, qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see no key yet
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(qk - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                p = p.to(v.dtype)
                if UPCAST:
                    p = p.to(tl.float32)
                    v = v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
                m_i = m_new
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            out_ptrs = (
                out_ptr
                + (q_start + rows)[:, None] * out_stride_t
                + head * out_stride_h
                + d[None, :]
            )
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def extend_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: PagedAttentionTables,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int = EXTEND_BLOCK_M,
    block_n: int = EXTEND_BLOCK_N,
) -> torch.Tensor:
    """Extend rows of q [T_ext, H, D] (sequence i's rows start at extend_q_starts[i], at positions
    kv_len - q_len ..) attend causally to their pages (prefix and new tokens, already stored)."""
    check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or tables.extend_page_table is None:
        return out
    table = tables.extend_page_table
    grid = (table.shape[0], num_heads, triton.cdiv(tables.max_extend_q_len, block_m))
    launch(
        _extend_kernel,
        grid,
        q,
        q,
        k_cache,
        v_cache,
        table,
        tables.extend_q_starts,
        tables.extend_q_lens,
        tables.extend_kv_lens,
        out,
        scale * LOG2E,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
        **dot_options(q),
        num_warps=4,
        num_stages=2,
    )
    return out


def prefill_attention_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: PagedAttentionTables,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """flash-attn varlen over extends without a cached prefix: q [T, H, D], k/v [T, Hkv, D]."""
    fn = flash_attn_varlen_func()
    cu = tables.extend_cu_seqlens
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    return fn(
        q,
        k,
        v,
        cu,
        cu,
        tables.max_extend_q_len,
        tables.max_extend_q_len,
        softmax_scale=scale,
        causal=True,
        window_size=window,
    )
