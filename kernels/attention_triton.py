"""Paged attention in Triton, with the same inputs as the torch reference in
`kernels/attention.py` (`paged_attention_triton` mirrors `paged_attention`).

- `paged_kv_triton`: page tables (`PagedAttentionTables`, `triton_metadata_from`) and the KV store;
- `decode_attention_triton`: decode, GQA, split-K;
- `extend_attention_triton`: ragged causal extend over a cached prefix; flash-attn for prefill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait.kernels.attention import TorchAttention
from plait.kernels.decode_attention_triton import decode_attention_triton
from plait.kernels.dispatch import use_flash_attn
from plait.kernels.extend_attention_triton import extend_attention_triton, prefill_attention_flash
from plait.kernels.paged_kv_triton import (
    PagedAttentionTables,
    choose_num_kv_splits,
    store_kv_triton,
    tables_from_pages,
    triton_metadata_from,
)

if TYPE_CHECKING:
    from plait.kernels.attention import AttentionMetadata, KVScales

__all__ = [
    "PagedAttentionTables",
    "choose_num_kv_splits",
    "decode_attention_triton",
    "extend_attention_triton",
    "paged_attention_triton",
    "prefill_attention_flash",
    "store_kv_triton",
    "TritonAttention",
    "tables_from_pages",
    "triton_metadata_from",
]


def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    tables: PagedAttentionTables | None = None,
    flash: bool | None = None,
) -> torch.Tensor:
    """Same contract as `attention.paged_attention`: stores k/v [T, Hkv, D], attends q [T, H, D].
    `flash`: whether prompts with nothing cached go to flash-attn (None: as `use_flash_attn`
    says for q)."""
    if flash is None:
        flash = use_flash_attn(q)
    if tables is None:
        tables = triton_metadata_from(meta, k_cache.shape[1], k_cache.shape[2])
    store_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    num_ext = tables.num_extend_tokens
    if num_ext:
        if tables.extends_have_no_prefix and flash:
            out[:num_ext] = prefill_attention_flash(
                q[:num_ext], k[:num_ext], v[:num_ext], tables, scale, sliding_window
            )
        else:
            extend_attention_triton(
                q[:num_ext], k_cache, v_cache, tables, scale, sliding_window, out[:num_ext]
            )
    if tables.decode_page_table is not None:
        decode_attention_triton(
            q[num_ext:],
            k_cache,
            v_cache,
            tables.decode_page_table,
            tables.decode_kv_lens,
            scale,
            sliding_window,
            tables.num_kv_splits,
            out[num_ext:],
        )
    return out


class TritonAttention(TorchAttention):
    """CUDA with Triton over a cache of the activations' dtype: `paged_attention_triton` on the
    page tables the runner built (`AttentionMetadata.triton`)."""

    name = "triton"

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
        super().__init__(device, dtype, head_dim)
        self.flash = use_flash_attn(torch.empty(0, dtype=dtype, device=device))

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
        del kv_scales  # a Triton backend is chosen only for float caches
        return paged_attention_triton(
            q, k, v, k_cache, v_cache, meta, scale, sliding_window, meta.triton
        )
