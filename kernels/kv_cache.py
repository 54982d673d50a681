"""Storage formats of the paged KV cache: float32, bfloat16, and int8 with a float32 scale per
(slot, kv head).

int8 is symmetric: scale = max|x| / 127 over the head's `head_dim` values, x ≈ scale * q. With
SmolLM2's head_dim of 64 a slot costs 64 + 4 bytes per head instead of 256 (float32), so 3.8x the
tokens fit; bfloat16 halves float32. The attention kernels read the stored type directly (the
native CPU kernel converts as it loads); the torch paths gather, then convert with `read_kv`.

A layer's scales are `[num_pages, page_size, num_kv_heads]`, one tensor for K and one for V,
passed around as `kv_scales = (k_scale, v_scale)`, or None for float caches.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from plait.kernels import native

KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
_KV_TYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def resolve_kv_dtype(
    setting: str, model_dtype: torch.dtype, device: torch.device, quantized: bool
) -> torch.dtype:
    """The cache dtype for `kv_cache_dtype=setting`. "auto" is the model's dtype, except for
    quantized weights (int8 / int4) on the CPU, whose float32 activations are stored in bfloat16:
    half the bytes (2x the tokens, and a decode step's attention reads half as much), as llama.cpp
    keeps a quantized GGUF's cache in float16; a batch's decode reads less, and perplexity stays
    close to a float32 cache's (docs/cpu.md, "KV cache dtype")."""
    if setting != "auto":
        return KV_CACHE_DTYPES[setting]
    if quantized and device.type == "cpu" and model_dtype == torch.float32:
        return torch.bfloat16
    return model_dtype


def kv_type_code(dtype: torch.dtype) -> int | None:
    """The native kernels' code for a cache dtype (None: no native support)."""
    return _KV_TYPE_CODES.get(dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float32 scales [...]), the reference of the native store."""
    x = x.float()
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(x * (1.0 / scale)[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


def flat_scales(
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[pages, page_size, Hkv] -> [slots, Hkv] views."""
    if kv_scales is None:
        return None
    k_scale, v_scale = kv_scales
    return k_scale.view(-1, k_scale.shape[-1]), v_scale.view(-1, v_scale.shape[-1])


def read_kv(
    flat: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The cache rows at `index` (any shape of slots) as `dtype`: [*index.shape, Hkv, D]."""
    rows = flat[index]
    if scales is not None:
        return dequantize_int8(rows, scales[index], dtype)
    return rows if rows.dtype == dtype else rows.to(dtype)


@cache
def _store_kernel() -> ctypes._CFuncPtr | None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, ptr, ptr, i64]
    return native.function("cpu_kernels", "plait_store_kv", argtypes, restype=i64)


def slot_error(slots: torch.Tensor, index: int, num_slots: int) -> IndexError:
    """The error for slots[index] lying outside a KV pool of `num_slots` (native kernels check
    before they write; the torch path's index_copy_ raises its own)."""
    return IndexError(
        f"slots[{index}] = {int(slots[index])} is outside the KV pool's {num_slots} slots"
    )


def _rows_fit_native_store(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
    """Rows the native store reads as they are: heads contiguous, the same row stride for k and
    v, contiguous int64 slots."""
    return (
        k.dtype == v.dtype == torch.float32
        and slots.dtype == torch.long
        and slots.is_contiguous()
        and k.stride()[1:] == v.stride()[1:] == (k.shape[2], 1)
        and k.stride(0) == v.stride(0)
    )


@dataclass(frozen=True)
class KVStore:
    """Writes new k/v into a layer's caches by the path chosen once (`choose_kv_store`): the
    native kernel (`native`: float32 CPU activations, the library built), for rows laid out as it
    reads them; else torch's `index_copy_`."""

    native: bool = False

    def __call__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new k/v [T, Hkv, D] at `slots` in the cache's format; returns the caches
        viewed flat, [slots, Hkv, D]."""
        num_tokens, num_kv_heads, head_dim = k.shape
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        code = kv_type_code(k_cache.dtype)
        if self.native and num_tokens and code is not None and _rows_fit_native_store(k, v, slots):
            ks, vs = kv_scales if kv_scales is not None else (None, None)
            bad = _store_kernel()(
                k.data_ptr(),
                v.data_ptr(),
                k.stride(0),
                slots.data_ptr(),
                num_tokens,
                num_kv_heads,
                head_dim,
                code,
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                None if ks is None else ks.data_ptr(),
                None if vs is None else vs.data_ptr(),
                k_flat.shape[0],
            )
            if bad >= 0:
                raise slot_error(slots, bad, k_flat.shape[0])
            return k_flat, v_flat
        if kv_scales is not None:
            k_scale, v_scale = flat_scales(kv_scales)
            kq, kscale = quantize_int8(k)
            vq, vscale = quantize_int8(v)
            k_flat.index_copy_(0, slots, kq)
            v_flat.index_copy_(0, slots, vq)
            k_scale.index_copy_(0, slots, kscale)
            v_scale.index_copy_(0, slots, vscale)
        else:
            k_flat.index_copy_(0, slots, k.to(k_flat.dtype))
            v_flat.index_copy_(0, slots, v.to(v_flat.dtype))
        return k_flat, v_flat


def choose_kv_store(device: torch.device, dtype: torch.dtype) -> KVStore:
    """The store for activations of `dtype` on `device`."""
    native_ok = (
        device.type == "cpu"
        and dtype == torch.float32
        and not native.native_disabled()
        and _store_kernel() is not None
    )
    return KVStore(native=native_ok)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`KVStore` by the path `choose_kv_store` picks for k (here for this one call; an engine's
    attention backend holds its choice)."""
    return choose_kv_store(k.device, k.dtype)(k, v, k_cache, v_cache, slots, kv_scales)
