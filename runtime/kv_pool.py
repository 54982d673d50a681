"""The paged KV pool: preallocated K and V tensors per layer. Page bookkeeping lives in radix_cache.

The pool stores float32, bfloat16 or int8 (`kernels/kv_cache.py`); an int8 pool also holds one
float32 scale per (slot, kv head) for K and for V.
"""

from __future__ import annotations

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
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        # NOTE: torch.empty leaves the memory untouched until written, so a large pool costs
        # address space, not resident memory, until it fills.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if dtype == torch.int8:
            scale_shape = shape[:-1]
            self.k_scale = [torch.ones(scale_shape, device=device) for _ in range(num_layers)]
            self.v_scale = [torch.ones(scale_shape, device=device) for _ in range(num_layers)]

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

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        per_head = head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)  # + the scale
        return 2 * num_layers * num_kv_heads * per_head
