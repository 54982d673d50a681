"""GGUF block types the quantized kernels read, as `QuantizedWeight`s: the values and scales of the
file's blocks, never re-quantized, so `dequantize_ref` of each equals `gguf.quants.dequantize` of
the blocks bit for bit (tests/integration/test_gguf_types.py).

| type | becomes | values | scales (and minimums) |
|---|---|---|---|
| Q4_0 | int4, groups of 32 | q (0..15) | d, minimum -8 d (float16, exact) |
| Q4_1 | int4, groups of 32 | q | d, m (float16, as stored) |
| Q8_0 | int8, groups of 32 | q | d (float16) |
| Q5_0 | int5, groups of 32 (int8 if 64 does not divide K) | q (int8: q - 16) | d (float16) |
| Q4_K | int4, groups of 32 | q, nibbles reordered | d * sc, -(dmin * m) (float32) |
| Q5_K | int5, groups of 32 | q (0..31) | d * sc, -(dmin * m) (float32) |
| Q6_K | int8, groups of 16 | q - 32 | d * sc (float32) |

A k-quant's effective scale is its superblock's float16 scale times a 6-bit (8-bit for Q6_K)
sub-block scale: at most 19 significant bits, exact in float32 but not in float16; `gguf` computes
the same float32 product, and q * scale is exact in float32 too, so the weights are the file's.
"""

from __future__ import annotations

import numpy as np
import torch

from plait.kernels.quant_weights import QuantizedWeight, pack_int4, pack_int5

BLOCK_BYTES = {
    "Q4_1": 20,
    "Q4_0": 18,
    "Q8_0": 34,
    "Q5_0": 22,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
}
BLOCK_SIZE = {"Q4_1": 32, "Q4_0": 32, "Q8_0": 32, "Q5_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
BLOCK_TYPES = tuple(BLOCK_BYTES)  # kept in their blocks for the quantized kernels


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float16."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K superblocks [B, bytes] -> float32 scales d * sc and minimums
    -(dmin * m) [B, 8]."""
    from gguf.quants import Q4_K

    d = _f16(raw[:, 0:2]).astype(np.float32)[:, None]
    dmin = _f16(raw[:, 2:4]).astype(np.float32)[:, None]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(raw[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def quantized_blocks(kind: str, raw: np.ndarray, n: int, k: int) -> QuantizedWeight:
    """The [n, k] matrix of `kind` blocks `raw` (uint8, the tensor's bytes) as a
    `QuantizedWeight`."""
    blocks = np.asarray(raw).view(np.uint8).reshape(-1, BLOCK_BYTES[kind])
    nb = blocks.shape[0]
    if kind in ("Q4_1", "Q4_0", "Q8_0"):
        scale = _f16(blocks[:, 0:2]).reshape(n, k // 32)
        if kind == "Q8_0":
            q = blocks[:, 2:34].copy().view(np.int8).reshape(n, k)
            return QuantizedWeight("int8", torch.from_numpy(q), torch.from_numpy(scale), None, 32)
        if kind == "Q4_1":
            low = _f16(blocks[:, 2:4]).reshape(n, k // 32)
            packed = blocks[:, 4:20]
        else:  # Q4_0: w = (q - 8) * d, exact in float16 (a power-of-two multiple)
            low = (scale * np.float16(-8.0)).astype(np.float16)
            packed = blocks[:, 2:18]
        return QuantizedWeight(
            "int4",
            torch.from_numpy(packed.reshape(n, k // 2).copy()),
            torch.from_numpy(scale),
            torch.from_numpy(np.ascontiguousarray(low)),
            32,
        )
    if kind == "Q5_0":  # w = (q - 16) * d, q = low nibble | high bit << 4
        scale = _f16(blocks[:, 0:2]).reshape(n, k // 32)
        qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)  # [B, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [B, 32]
        qs = blocks[:, 6:22]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # elements 0..15, then 16..31
        q = (low | (high << 4)).reshape(n, k)
        if k % 64 == 0:
            return QuantizedWeight(
                "int5", pack_int5(torch.from_numpy(q)), torch.from_numpy(scale), None, 32
            )
        q8 = (q.astype(np.int16) - 16).astype(np.int8)
        return QuantizedWeight("int8", torch.from_numpy(q8), torch.from_numpy(scale), None, 32)
    if kind == "Q4_K":
        scale, low = _k_scales(blocks)
        qs = blocks[:, 16:144].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(
            1, 1, 2, 1
        )
        q = torch.from_numpy(
            (qs & 0x0F).reshape(n, k)
        )  # sub-block j: chunk j // 2's low or high nibbles
        return QuantizedWeight(
            "int4",
            pack_int4(q, 32),
            torch.from_numpy(scale.reshape(n, k // 32)),
            torch.from_numpy(np.ascontiguousarray(low.reshape(n, k // 32))),
            32,
        )
    if kind == "Q5_K":
        scale, low = _k_scales(blocks)
        qh = blocks[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        ql = blocks[:, 48:176].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(
            1, 1, 2, 1
        )
        q = ((ql & 0x0F).reshape(nb, 8, 32) | ((qh & 1) << 4)).reshape(n, k)
        return QuantizedWeight(
            "int5",
            pack_int5(torch.from_numpy(q)),
            torch.from_numpy(scale.reshape(n, k // 32)),
            torch.from_numpy(np.ascontiguousarray(low.reshape(n, k // 32))),
            32,
        )
    if kind == "Q6_K":
        ql = blocks[:, 0:128].reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(
            1, 1, 2, 1
        )
        qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array(
            [0, 2, 4, 6], dtype=np.uint8
        ).reshape(1, 1, 4, 1)
        q = (ql & 0x0F).reshape(nb, 2, 128) | ((qh & 0x03).reshape(nb, 2, 128) << 4)
        q = (q.astype(np.int16) - 32).astype(np.int8).reshape(n, k)
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        scale = _f16(blocks[:, 208:210]).astype(np.float32)[:, None] * sc  # [B, 16]
        return QuantizedWeight(
            "int8", torch.from_numpy(q), torch.from_numpy(scale.reshape(n, k // 16)), None, 16
        )
    raise ValueError(f"quantized_blocks: {kind} is not one of {', '.join(BLOCK_TYPES)}")
