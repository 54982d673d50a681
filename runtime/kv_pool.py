"""The paged KV pool: preallocated K and V tensors per layer. Page bookkeeping lives in radix_cache.

The pool stores float32, bfloat16 or int8 (`kernels/kv_cache.py`); an int8 pool also holds one
float32 scale per (slot, kv head) for K and for V.

A model with sliding-window layers keeps their K and V in a second, smaller set of pages
(`num_window_pages`; `radix_cache.WindowPages` maps a request's pages to them), so that those
layers hold about a window of tokens per request however long its context grows. The other
layers' tensors have `num_pages` pages, as the page tables index them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVPool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        window_layers: Sequence[bool] = (),
        num_window_pages: int = 0,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window_layers = tuple(window_layers) or (False,) * num_layers
        self.num_window_pages = num_window_pages
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        for window in self.window_layers:
            pages = num_window_pages if window else num_pages
            shape = (pages, page_size, num_kv_heads, head_dim)
            # NOTE: torch.empty leaves the memory untouched until written, so a large pool costs
            # address space, not resident memory, until it fills. The window pages start zeroed:
            # a page table's released pages read as the window's page 0, which the window mask
            # then leaves out, and masked values must be finite (0 * NaN is NaN).
            make = torch.zeros if window else torch.empty
            self.k.append(make(shape, dtype=dtype, device=device))
            self.v.append(make(shape, dtype=dtype, device=device))
            if dtype == torch.int8:
                self.k_scale.append(torch.ones(shape[:-1], device=device))
                self.v_scale.append(torch.ones(shape[:-1], device=device))

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The int8 pool's (k_scale, v_scale) of a layer; None for float pools."""
        if not self.k_scale:
            return None
        return self.k_scale[layer_id], self.v_scale[layer_id]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def has_window_layers(self) -> bool:
        return any(self.window_layers)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        per_head = head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)  # + the scale
        return 2 * num_layers * num_kv_heads * per_head
