"""Paged decode attention in Triton: one query token per sequence over its pages, all query heads
of a KV head (GQA) sharing each K/V load, the context split across programs (split-K) and merged
by log-sum-exp, so one long sequence still fills the GPU."""

from __future__ import annotations

import torch

from plait.kernels.dispatch import launch
from plait.kernels.paged_kv_triton import LOG2E, check_cache, dot_options
from plait.kernels.tuning import DECODE_BLOCK_N

try:
    import triton
    import triton.language as tl
except ImportError:  # Linux-only wheels; the torch reference needs nothing else
    triton = None


if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr,
        k_cache,
        v_cache,
        page_table,
        kv_lens,
        out_ptr,
        lse_ptr,
        qk_scale,
        window,
        num_splits,
        q_stride_b,
        q_stride_h,
        cache_stride_page,
        cache_stride_slot,
        cache_stride_head,
        table_stride,
        out_stride_b,
        out_stride_h,
        out_stride_s,
        lse_stride_b,
        lse_stride_h,
        GROUP: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        STORE_LSE: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        UPCAST: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # grid: (batch, kv heads, splits); all GROUP query heads of one kv head share each K/V load
        b = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(kv_lens + b)
        start = 0
        if HAS_WINDOW:
            start = tl.maximum(kv_len - window, 0)
        per_split = tl.cdiv(tl.cdiv(kv_len - start, num_splits), BLOCK_N) * BLOCK_N
        lo = start + split * per_split
        hi = tl.minimum(lo + per_split, kv_len)

        h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + h
        d = tl.arange(0, BLOCK_D)
        hd_mask = (h[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
        q = tl.load(
            q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + d[None, :],
            mask=hd_mask,
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        head_offset = kv_head * cache_stride_head
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < hi
            page = tl.load(page_table + b * table_stride + pos // PAGE_SIZE, mask=valid, other=0)
            rows = (
                page.to(tl.int64) * cache_stride_page
                + (pos % PAGE_SIZE) * cache_stride_slot
                + head_offset
            )
            nd_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
            k = tl.load(
                k_cache + rows[:, None] + d[None, :], mask=nd_mask, other=0.0
            )  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_cache + rows[:, None] + d[None, :], mask=nd_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            qk = (
                tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            )  # [BLOCK_H, BLOCK_N]
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(v.dtype)
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        out_ptrs = (
            out_ptr
            + b * out_stride_b
            + heads[:, None] * out_stride_h
            + split * out_stride_s
            + d[None, :]
        )
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
        if STORE_LSE:
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(lse_ptr + b * lse_stride_b + heads * lse_stride_h + split, lse, mask=h < GROUP)

    @triton.jit
    def _decode_combine_kernel(
        mid_ptr,
        lse_ptr,
        out_ptr,
        num_splits,
        mid_stride_b,
        mid_stride_h,
        mid_stride_s,
        lse_stride_b,
        lse_stride_h,
        out_stride_b,
        out_stride_h,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        # grid: (batch, heads); merges the splits' partial softmaxes by their log-sum-exp
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        lse = tl.load(
            lse_ptr + b * lse_stride_b + h * lse_stride_h + s,
            mask=s < num_splits,
            other=float("-inf"),
        )
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # [BLOCK_S]
        parts = tl.load(
            mid_ptr + b * mid_stride_b + h * mid_stride_h + s[:, None] * mid_stride_s + d[None, :],
            mask=(s[:, None] < num_splits) & (d[None, :] < HEAD_DIM),
            other=0.0,
        )  # [BLOCK_S, BLOCK_D]
        total = tl.sum(w, 0)
        out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0.0, total, 1.0)
        tl.store(
            out_ptr + b * out_stride_b + h * out_stride_h + d,
            out.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_kv_splits: int = 1,
    out: torch.Tensor | None = None,
    block_n: int = DECODE_BLOCK_N,
) -> torch.Tensor:
    """q [B, H, D] (one token per sequence, at position kv_len - 1) over its pages -> [B, H, D].

    page_table [B, max_pages] int32, kv_lens [B] int32 (the new token's K/V already stored).
    """
    check_cache(k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads or q.stride(2) != 1:
        raise ValueError(f"decode_attention_triton: {num_heads} heads over {num_kv_heads} kv heads")
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    splits = max(1, num_kv_splits)
    if splits > 1:
        mid = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
        target, strides = mid, (mid.stride(0), mid.stride(1), mid.stride(2))
    else:
        lse, target, strides = out, out, (out.stride(0), out.stride(1), 0)
    launch(
        _decode_kernel,
        (batch, num_kv_heads, splits),
        q,
        q,
        k_cache,
        v_cache,
        page_table,
        kv_lens,
        target,
        lse,
        scale * LOG2E,
        sliding_window or 0,
        splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_table.stride(0),
        *strides,
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        STORE_LSE=splits > 1,
        HAS_WINDOW=sliding_window is not None,
        **dot_options(q),
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        launch(
            _decode_combine_kernel,
            (batch, num_heads),
            q,
            mid,
            lse,
            out,
            splits,
            mid.stride(0),
            mid.stride(1),
            mid.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out
