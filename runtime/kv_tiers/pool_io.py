"""Copies between the KV pool's pages and the flat payloads of stored blocks (`BlockLayout`).

The only tier code that touches tensors: `gather` snapshots pages on the engine loop (the pool's
pages may be reused as soon as it returns), `payload` lays one block of a snapshot out as bytes on
the tiers' writer thread, and `scatter` copies a loaded payload into fresh pages on the loop.

A payload is the block's K and V, `[num_layers, 2, block_pages, page_size, num_kv_heads,
head_dim]` in the pool's dtype, followed for an int8 pool by their scales, `[num_layers, 2,
block_pages, page_size, num_kv_heads]` float32.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from plait.runtime.kv_pool import KVPool
from plait.runtime.kv_tiers.block_format import BlockLayout


@dataclass
class Snapshot:
    """A copy of whole blocks of pages, in host memory."""

    kv: torch.Tensor  # [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
    scales: torch.Tensor | None  # [num_layers, 2, num_pages, page_size, num_kv_heads]

    @property
    def nbytes(self) -> int:
        extra = self.scales.nbytes if self.scales is not None else 0
        return self.kv.nbytes + extra


class PoolBlockIO:
    def __init__(self, pool: KVPool, block_pages: int) -> None:
        self.pool = pool
        k = pool.k[0]
        _, page_size, num_kv_heads, head_dim = k.shape
        self.layout = BlockLayout(
            num_layers=len(pool.k),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=str(k.dtype).removeprefix("torch."),
            itemsize=k.dtype.itemsize,
            page_size=page_size,
            block_pages=block_pages,
            scales=bool(pool.k_scale),
        )

    def gather(self, pages: list[int]) -> Snapshot:
        """Copies `pages` (whole blocks, block after block) out of the pool."""
        pool, lay = self.pool, self.layout
        idx = torch.tensor(pages, dtype=torch.long, device=pool.k[0].device)
        shape = (lay.num_layers, 2, len(pages), lay.page_size, lay.num_kv_heads)
        kv = torch.empty((*shape, lay.head_dim), dtype=pool.k[0].dtype)
        scales = torch.empty(shape, dtype=torch.float32) if lay.scales else None
        for layer in range(lay.num_layers):
            for j, src in enumerate((pool.k[layer], pool.v[layer])):
                kv[layer, j].copy_(src.index_select(0, idx))
            if scales is not None:
                for j, src in enumerate((pool.k_scale[layer], pool.v_scale[layer])):
                    scales[layer, j].copy_(src.index_select(0, idx))
        return Snapshot(kv, scales)

    def payload(self, snapshot: Snapshot, block: int) -> memoryview:
        """The `block`-th block of a snapshot as one contiguous payload."""
        bp = self.layout.block_pages
        parts = [snapshot.kv[:, :, block * bp : (block + 1) * bp]]
        if snapshot.scales is not None:
            parts.append(snapshot.scales[:, :, block * bp : (block + 1) * bp])
        flats = [p.contiguous().view(torch.uint8).reshape(-1) for p in parts]
        flat = flats[0] if len(flats) == 1 else torch.cat(flats)  # a whole snapshot: no copy
        return memoryview(flat.numpy()).cast("B")

    def scatter(self, payload: memoryview, first_page: int, pages: list[int]) -> None:
        """Copies the block's pages from `first_page` on into the pool's `pages`."""
        pool, lay = self.pool, self.layout
        with warnings.catch_warnings():  # read-only bytes: only read from here
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=torch.uint8)
        shape = (lay.num_layers, 2, lay.block_pages, lay.page_size, lay.num_kv_heads)
        kv_bytes = lay.num_layers * 2 * lay.block_pages * lay.page_size * lay.num_kv_heads
        kv_bytes *= lay.head_dim * lay.itemsize
        dtype = pool.k[0].dtype
        kv = raw[:kv_bytes].view(dtype).view(*shape, lay.head_dim)[:, :, first_page:]
        device = pool.k[0].device
        idx = torch.tensor(pages, dtype=torch.long, device=device)
        for layer in range(lay.num_layers):
            pool.k[layer].index_copy_(0, idx, kv[layer, 0].to(device))
            pool.v[layer].index_copy_(0, idx, kv[layer, 1].to(device))
        if lay.scales:
            scales = raw[kv_bytes:].view(torch.float32).view(*shape)[:, :, first_page:]
            for layer in range(lay.num_layers):
                pool.k_scale[layer].index_copy_(0, idx, scales[layer, 0].to(device))
                pool.v_scale[layer].index_copy_(0, idx, scales[layer, 1].to(device))
