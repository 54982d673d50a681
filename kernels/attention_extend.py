"""One sequence's new tokens attending over its prefix (an extend: a prompt chunk, or a cached
prefix's continuation): the reference, the CPU kernels (bfloat16 tiles, the native flash-style
kernel, torch's blocked path) and the choice between them, made once per attention backend
(`choose_extend`) or per call (`extend_attention`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from plait.kernels import native
from plait.kernels.tuning import BF16_EXTEND_MIN_Q, BF16_EXTEND_MIN_WORK


@dataclass(frozen=True)
class ExtendKernel:
    """How one sequence's new tokens attend over its prefix, chosen once (`choose_extend`) for the
    activations' device and dtype and the model's head size: on the CPU, bfloat16 tiles where a
    step asks (`bf16`) and `takes_bf16_extend` says so, else the native flash-style kernel
    (`native`), else `blocked_extend_attention`; elsewhere the reference."""

    cpu: bool = False
    native: bool = False

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefix_len: int,
        scale: float,
        sliding_window: int | None = None,
        bf16: bool = False,
    ) -> torch.Tensor:
        """q [q_len, H, D] at positions prefix_len.., k/v [kv_len, Hkv, D] from 0: [q_len, H, D]."""
        if not self.cpu:
            return extend_attention_ref(q, k, v, prefix_len, scale, sliding_window)
        if bf16 and sliding_window is None and takes_bf16_extend(q.shape[0], prefix_len):
            out = bf16_extend_attention(q, k, v, prefix_len, scale)
            if out is not None:
                return out
        if self.native:
            out = _call_native_extend(q, k, v, prefix_len, scale, sliding_window)
            if out is not None:
                return out
        return blocked_extend_attention(q, k, v, prefix_len, scale, sliding_window)


def choose_extend(device: torch.device, dtype: torch.dtype, head_dim: int) -> ExtendKernel:
    """The extend kernel for activations of `dtype` on `device` with heads of `head_dim`: the
    native one takes float32 CPU heads of a multiple of 8 where the library built."""
    if device.type != "cpu":
        return ExtendKernel()
    native_ok = (
        dtype == torch.float32
        and head_dim > 0  # 0: not known in advance
        and head_dim % 8 == 0
        and not native.native_disabled()
        and _native_extend() is not None
    )
    return ExtendKernel(cpu=True, native=native_ok)


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    sliding_window: int | None = None,
    bf16: bool = False,
) -> torch.Tensor:
    """One sequence: q [q_len, H, D] at positions prefix_len.., k/v [kv_len, Hkv, D] from 0, by
    the kernel `choose_extend` picks for q (here for this one call; an engine's attention backend
    holds its choice)."""
    kernel = choose_extend(q.device, q.dtype, q.shape[2])
    return kernel(q, k, v, prefix_len, scale, sliding_window, bf16)


def extend_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The reference: causal attention of q [q_len, H, D] at positions prefix_len.. over k/v
    [kv_len, Hkv, D] from 0, by torch's scaled dot product."""
    q_len, kv_len = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, len, D]
    if prefix_len == 0 and sliding_window is None:
        out = F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        q_pos = torch.arange(prefix_len, prefix_len + q_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        mask = k_pos <= q_pos  # [q_len, kv_len]
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out.transpose(0, 1)  # [q_len, H, D]


@cache
def _native_extend() -> Any:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return native.function(
        "cpu_kernels",
        "plait_extend_attention_f32",
        [p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_int],
        ctypes.c_int,
    )


def native_extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """`extend_attention_ref` by the native flash-style kernel (`csrc/cpu_extend_attention.cpp`),
    or None where it does not serve: builds without AVX2, other dtypes, head_dim not a multiple of
    8. It runs a prefill's attention faster than the blocked torch path: keys and values are read
    by blocks under an online softmax, so no score matrix larger than a block's is made."""
    if (
        native.native_disabled()
        or q.dtype != torch.float32
        or k.dtype != torch.float32
        or v.dtype != torch.float32
        or q.shape[2] % 8
        or _native_extend() is None
    ):
        return None
    return _call_native_extend(q, k, v, prefix_len, scale, sliding_window)


def _call_native_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """The native extend kernel on float32 CPU tensors (None where it declines the call)."""
    if k.shape[0] != prefix_len + q.shape[0]:
        return None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    rc = _native_extend()(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        q.shape[0],
        prefix_len,
        q.shape[1],
        k.shape[1],
        q.shape[2],
        scale,
        sliding_window or 0,
        torch.get_num_threads(),
    )
    return out if rc == 0 else None


def takes_bf16_extend(q_len: int, prefix_len: int) -> bool:
    """Whether `q_len` new tokens after `prefix_len` cached ones attend in bfloat16 (where the model
    runs its prefill in bfloat16): from BF16_EXTEND_MIN_Q new tokens, once new tokens x keys reach
    BF16_EXTEND_MIN_WORK, below which converting the operands costs more than the tiles save:
    the float32 kernel wins on a short prompt alone, the bfloat16 tiles once the new tokens, or the
    keys they attend to, are many."""
    return q_len >= BF16_EXTEND_MIN_Q and q_len * (prefix_len + q_len) >= BF16_EXTEND_MIN_WORK


def bf16_extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor | None:
    """`extend_attention_ref` on torch's CPU flash attention in bfloat16 (AMX tiles where the CPU
    has them): q, k and v rounded to bfloat16, softmax sums in float32, each output rounded to
    bfloat16. A cached prefix and the new tokens are attended apart (the prefix whole, the new
    tokens causally) and merged by their log-sum-exps. None where this torch lacks the operator.
    On AMX tiles this runs a long extend faster than the native float32 kernel, and the more so the
    longer the new tokens or the cached prefix."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None:
        return None
    (q_len, num_heads, head_dim), num_kv_heads = q.shape, k.shape[1]
    group = num_heads // num_kv_heads
    # NOTE: contiguous operands, each made in one copy: the kernel reads strided ones slower
    qt = torch.empty(num_heads, q_len, head_dim, dtype=torch.bfloat16).copy_(q.transpose(0, 1))[
        None
    ]

    def heads(
        t: torch.Tensor, repeat: int
    ) -> torch.Tensor:  # [len, Hkv, D] -> [1, Hkv * repeat, len, D]
        t = t.transpose(0, 1).to(torch.bfloat16)
        return (t.repeat_interleave(repeat, dim=0) if repeat > 1 else t)[None]

    out, lse = flash(
        qt, heads(k[prefix_len:], group), heads(v[prefix_len:], group), 0.0, True, scale=scale
    )
    if prefix_len:
        # the prefix, which every new token sees whole: a KV head's query heads stacked as rows of
        # one head, so that its keys and values are converted once and not copied per query head
        # (the longer the cached prefix, the more that saves)
        stacked = qt.view(1, num_kv_heads, group * q_len, head_dim)  # [1, Hkv, G * q_len, D]
        old, old_lse = flash(
            stacked, heads(k[:prefix_len], 1), heads(v[:prefix_len], 1), 0.0, False, scale=scale
        )
        # back to [1, H, q_len, D] and [1, H, q_len]: query head h = kv head * G + g, as `heads`
        # repeats them
        old, old_lse = (
            old.reshape(1, num_heads, q_len, head_dim),
            old_lse.reshape(1, num_heads, q_len),
        )
        top = torch.maximum(lse, old_lse)
        w_new, w_old = (lse - top).exp_().unsqueeze(-1), (old_lse - top).exp_().unsqueeze(-1)
        out = (out.float() * w_new + old.float() * w_old) / (w_new + w_old)
    return out[0].transpose(0, 1).float()


def blocked_extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    sliding_window: int | None = None,
    block: int = 128,
) -> torch.Tensor:
    """`extend_attention_ref` for the CPU, by blocks of `block` queries.

    Each block attends only to the keys it can see (causal, and the window), so about half of the
    score matrix of a prefill is never computed: faster than `scaled_dot_product_attention`, whose
    CPU causal path computes and masks the whole matrix.
    """
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    dtype = q.dtype
    # the `group` query heads of a KV head are stacked as one matrix: [Hkv, group, q_len, D]; K and
    # V are never repeated per query head
    qt = (q.float() * scale).view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kt, vt = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [Hkv, kv_len, D]
    out = torch.empty(num_kv_heads, group, q_len, head_dim, dtype=torch.float32, device=q.device)
    # keys up to a block's first query are visible to all of it; only the diagonal square needs a
    # mask (and, with a window, the keys leaving it)
    diagonal = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)
    for s in range(0, q_len, block):
        e = min(q_len, s + block)
        n = e - s
        hi = prefix_len + e  # keys [lo, hi) are visible to some query of the block
        lo = 0 if sliding_window is None else max(0, prefix_len + s - sliding_window + 1)
        qb = qt[:, :, s:e].reshape(num_kv_heads, group * n, head_dim)
        scores = torch.matmul(qb, kt[:, lo:hi].transpose(1, 2)).view(
            num_kv_heads, group, n, hi - lo
        )
        scores[..., hi - lo - n :].masked_fill_(diagonal[:n, :n], float("-inf"))
        if sliding_window is not None:
            q_pos = torch.arange(prefix_len + s, prefix_len + e, device=q.device)[:, None]
            k_pos = torch.arange(lo, hi, device=q.device)[None, :]
            scores.masked_fill_(k_pos <= q_pos - sliding_window, float("-inf"))
        probs = scores.softmax(-1).view(num_kv_heads, group * n, hi - lo)
        out[:, :, s:e] = torch.matmul(probs, vt[:, lo:hi]).view(num_kv_heads, group, n, head_dim)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(dtype)
