"""Attention over a paged KV cache: the torch backend (`TorchAttention`), the extend kernels it
chooses between, and the dispatch point for callers outside an engine (`paged_attention`).

The KV cache of one layer is `[num_pages, page_size, num_kv_heads, head_dim]`; viewed flat it is
`[num_slots, num_kv_heads, head_dim]` with slot = page * page_size + offset. A forward batch is
ragged: the tokens of extend (prefill) sequences come first, then one token per decode sequence.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from plait.kernels import native
from plait.kernels.dispatch import use_triton
from plait.kernels.kv_cache import choose_kv_store, flat_scales, read_kv, store_kv
from plait.kernels.tuning import BF16_EXTEND_MIN_Q, BF16_EXTEND_MIN_WORK

if TYPE_CHECKING:
    from plait.kernels.attention_cpu import CpuRows
    from plait.kernels.paged_kv_triton import PagedAttentionTables

KVScales = (
    tuple[torch.Tensor, torch.Tensor] | None
)  # int8 caches: (k_scale, v_scale) [pages, page_size, Hkv]


@dataclass
class AttentionMetadata:
    """Per-forward attention layout, built once by the model runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    extend_q_starts: list[int]  # per extend sequence: first row in the flat batch
    extend_q_lens: list[int]  # per extend sequence: new tokens
    extend_kv_lens: list[int]  # per extend sequence: cached prefix + new tokens
    extend_kv_slots: list[torch.Tensor]  # per extend sequence: [kv_len] long
    decode_kv_slots: torch.Tensor | None = None  # [B, max_kv_len] long, padded with 0
    decode_kv_lens: torch.Tensor | None = None  # [B] long
    decode_mask: torch.Tensor | None = (
        None  # [B, 1, 1, max_kv_len] bool, True = attend (None: from the lens)
    )
    bf16_extends: bool = False  # long CPU extends attend in bfloat16 (`bf16_extend_attention`)
    # every CPU token an attention row whose result does not depend on the batch (the engine's
    # `deterministic` mode): the native rows kernel splits each row by its own length alone
    batch_invariant: bool = False
    triton: PagedAttentionTables | None = (
        None  # the CUDA kernels' page tables (the runner builds them)
    )
    cpu: CpuRows | None = None  # the native CPU kernels' rows (the runner builds them)

    @property
    def num_extend_tokens(self) -> int:
        return sum(self.extend_q_lens)

    @property
    def num_decode(self) -> int:
        return 0 if self.decode_kv_slots is None else self.decode_kv_slots.shape[0]


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: KVScales = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stores the new k/v [T, Hkv, D] at `slots`; returns the caches viewed flat,
    [slots, Hkv, D]."""
    return store_kv(k, v, k_cache, v_cache, slots, kv_scales)


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


def decode_attention_ref(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    kv_slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    kv_scales: KVScales = None,
) -> torch.Tensor:
    """A batch of single-token queries q [B, H, D] over gathered pages; mask [B, 1, 1, L]."""
    ks, vs = flat_scales(kv_scales) or (None, None)
    k = read_kv(k_flat, ks, kv_slots, q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
    v = read_kv(v_flat, vs, kv_slots, q.dtype).transpose(1, 2)
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
    )  # [B, H, 1, D]
    return out.squeeze(2)


def paged_attention(
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
    """The dispatch point for callers outside an engine (an engine chooses its backend once,
    `layer_ops.choose_layer_ops`): Triton kernels on CUDA tensors (a cache of the model's dtype),
    the native row kernel on float32 CPU queries (when it builds), the torch reference elsewhere."""
    from plait.kernels import attention_cpu
    from plait.kernels.layer_ops import create_attention

    if use_triton(q) and kv_scales is None and k_cache.dtype == q.dtype:
        kind = "triton"
    elif attention_cpu.use_native_attention(q, k_cache):
        kind = "native"
    else:
        kind = "torch"
    backend = create_attention(kind, q.device, q.dtype, q.shape[2])
    return backend.attend(q, k, v, k_cache, v_cache, meta, scale, sliding_window, kv_scales)


class TorchAttention:
    """A paged-attention backend, built once for an engine's activations (`layer_ops.
    create_attention`) and called by every layer: `attend` stores the new k/v [T, Hkv, D] in the
    layer's caches, then attends q [T, H, D] over them. This one is torch's: each extend by the
    `ExtendKernel` chosen for the activations, decode rows by `decode_attention_ref` over gathered
    pages; the others (`attention_cpu.NativeAttention`, `attention_triton.TritonAttention`)
    share its contract."""

    name = "torch"

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
        self.extend = choose_extend(device, dtype, head_dim)
        self.store = choose_kv_store(device, dtype)

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
        """[T, heads, D]."""
        k_flat, v_flat = self.store(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        out = torch.empty_like(q)
        self.attend_extends(
            q, k, v, k_flat, v_flat, meta, scale, sliding_window, out, kv_scales=kv_scales
        )
        if meta.decode_kv_slots is not None:
            first = meta.num_extend_tokens
            mask = meta.decode_mask
            if mask is None:  # the model runner leaves it to the reference path, its only reader
                width = meta.decode_kv_slots.shape[1]
                lens = meta.decode_kv_lens[:, None]
                mask = (torch.arange(width, device=q.device)[None, :] < lens)[:, None, None, :]
            if sliding_window is not None:
                positions = torch.arange(mask.shape[-1], device=q.device)
                lower = (meta.decode_kv_lens - sliding_window)[:, None, None, None]
                mask = mask & (positions >= lower)
            out[first:] = decode_attention_ref(
                q[first:], k_flat, v_flat, meta.decode_kv_slots, mask, scale, kv_scales
            )
        return out

    def attend_extends(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
        skip: frozenset[int] = frozenset(),
        kv_scales: KVScales = None,
    ) -> None:
        """Writes each extend sequence's attention into `out` (those in `skip` excepted): over
        its new k/v alone when nothing is cached, else over its cached prefix gathered from the
        pages."""
        for i, (start, q_len, kv_len, slots) in enumerate(
            zip(meta.extend_q_starts, meta.extend_q_lens, meta.extend_kv_lens, meta.extend_kv_slots)
        ):
            if i in skip:
                continue
            prefix_len = kv_len - q_len
            if prefix_len == 0:
                kk, vv = k[start : start + q_len], v[start : start + q_len]
            else:
                ks, vs = flat_scales(kv_scales) or (None, None)
                kk, vv = read_kv(k_flat, ks, slots, q.dtype), read_kv(v_flat, vs, slots, q.dtype)
            out[start : start + q_len] = self.extend(
                q[start : start + q_len],
                kk,
                vv,
                prefix_len,
                scale,
                sliding_window,
                meta.bf16_extends,
            )


def paged_attention_ref(
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
    """Writes the new k/v [T, Hkv, D] into the cache, then attends q [T, H, D]; returns
    [T, H, D] (`TorchAttention`, chosen here for q)."""
    backend = TorchAttention(q.device, q.dtype, q.shape[2])
    return backend.attend(q, k, v, k_cache, v_cache, meta, scale, sliding_window, kv_scales)
