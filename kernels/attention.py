"""Attention over a paged KV cache: its per-forward layout (`AttentionMetadata`), the torch backend
(`TorchAttention`, with the extend kernel `attention_extend.choose_extend` picks for it), and the
dispatch point for callers outside an engine (`paged_attention`).

The KV cache of one layer is `[num_pages, page_size, num_kv_heads, head_dim]`; viewed flat it is
`[num_slots, num_kv_heads, head_dim]` with slot = page * page_size + offset. A forward batch is
ragged: the tokens of extend (prefill) sequences come first, then one token per decode sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from plait.kernels.attention_extend import choose_extend
from plait.kernels.dispatch import use_triton
from plait.kernels.kv_cache import choose_kv_store, flat_scales, read_kv, store_kv

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
