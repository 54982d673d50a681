"""Weight-only quantization: the formats of quantized weights, the quantizers, and the torch
reference of what the native kernels (`quant_matmul.py`) compute.

Three formats, all grouped along the input dimension K, with float16 scales (and minimums), as
GGUF stores them:

- `int8`: symmetric, `w = q * scale`, q in [-127, 127]; one scale per row (per-channel, the
  default) or per group (GGUF Q8_0 is int8 with groups of 32).
- `int4`: asymmetric, `w = q * scale + min`, q in [0, 15], groups of 32 by default — the GGUF
  Q4_1 block, so a Q4_1 file loads without re-quantizing. Two weights per byte: in each group, byte
  j holds weight j (low nibble) and weight j + group/2 (high nibble), as in GGUF.
- `int5`: five-bit values q in [0, 31], groups of 32, K a multiple of 64, `w = (q - 16) * scale`
  without minimums (GGUF Q5_0) and `w = q * scale + min` with them (Q5_K). Packed per row in
  chunks of 64 weights: the chunk's 32 nibble bytes (byte j: weight j low, weight j + 32 high),
  all chunks' nibbles first, then each chunk's fifth bits as 8 bytes (bit i: weight i), so a row
  is K / 2 + K / 8 bytes (`pack_int5`): the bytes Q5_0 holds, where an int8 per weight would take
  K bytes.

GGUF's k-quants load as these formats with float32 scales (and minimums), never re-quantized:
their effective scale per 16 or 32 weights (the sub-block's 6- or 8-bit scale times the
superblock's float16 one) is exact in float32, not in float16. Q4_K is `int4` (its nibbles
reordered to the order above) with float32 scales and minimums; Q5_K `int5` with float32 scales
and minimums per 32; Q6_K `int8` (values q - 32) with float32 scales per 16. Q5_0 is `int5` with
its float16 scales (as `int8`, values q - 16, where K is not a multiple of 64). `dequantize_ref` of
each is `gguf.quants.dequantize` of the file's blocks, bit for bit; the kernels read them at one
`FORMAT_CODE` each. A fused matrix whose pieces differ in type holds them all widened to one int8
format (`QuantizedWeight.stack`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("int8", "int4", "int5")
# (format, scale dtype) -> the kernel's format code (csrc/plait_kernels.h: PlaitWeightFormat);
# "float32" is plain weights, see `quant_matmul.dense_matmul`
FORMAT_CODE = {
    "int8": 0,
    "int4": 1,
    "float32": 2,
    "int8-f32": 3,
    "int4-f32": 4,
    "int5": 5,
    "int5-f32": 6,
}
Q8_BLOCK = 32  # decode rows round activations to int8 in blocks of this many (see `q8_activations`)


@dataclass
class QuantizedWeight:
    """A [N, K] weight matrix in one of `FORMATS`."""

    format: str
    qweight: torch.Tensor  # int8 [N, K], uint8 [N, K // 2] (int4) or [N, K // 2 + K // 8] (int5)
    scales: torch.Tensor  # float16, or float32 (k-quants) [N, K // group]
    # the scales' dtype, one per 32 weights [N, K // 32]: int4; int5 with float32 scales; int8 with
    # float32 scales where set (a Q5_K's values 0..31; int4 parts widened to stack, `stack`)
    mins: torch.Tensor | None
    group: int

    def __post_init__(self) -> None:
        if self.scales.dtype not in (torch.float16, torch.float32):
            raise ValueError(
                f"QuantizedWeight: scales must be float16 or float32, got {self.scales.dtype}"
            )
        if self.mins is not None and self.mins.dtype != self.scales.dtype:
            raise ValueError(
                f"QuantizedWeight: mins must be {self.scales.dtype} as the scales, "
                f"got {self.mins.dtype}"
            )
        if self.scales.dtype == torch.float16 and self.format == "int8" and self.mins is not None:
            raise ValueError("QuantizedWeight: int8 with float16 scales has no mins")
        if self.mins is not None and self.format == "int8" and self.group not in (16, Q8_BLOCK):
            raise ValueError(
                f"QuantizedWeight: int8 mins need groups of 16 or {Q8_BLOCK}, got {self.group}"
            )
        if self.format == "int5":
            k = self.scales.shape[1] * self.group
            if self.group != Q8_BLOCK or k % 64:
                raise ValueError(
                    f"QuantizedWeight: int5 needs groups of {Q8_BLOCK} and K a multiple of 64, "
                    f"got group {self.group}, K {k}"
                )
            if (self.mins is None) != (self.scales.dtype == torch.float16):
                raise ValueError(
                    "QuantizedWeight: int5 has float16 scales without mins (centered values) "
                    "or float32 scales with mins"
                )

    @property
    def code(self) -> int:
        """The kernel's format code (`FORMAT_CODE`): the format and its scales' dtype."""
        return FORMAT_CODE[
            self.format if self.scales.dtype == torch.float16 else f"{self.format}-f32"
        ]

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        """Bytes one matmul reads: the packed weights and their scales (and mins)."""
        extra = 0 if self.mins is None else self.mins.nbytes
        return self.qweight.nbytes + self.scales.nbytes + extra

    def row_range(self, start: int, stop: int) -> QuantizedWeight:
        """Rows [start, stop), as views of these tensors (no copy)."""
        mins = None if self.mins is None else self.mins[start:stop]
        return QuantizedWeight(
            self.format, self.qweight[start:stop], self.scales[start:stop], mins, self.group
        )

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation or a selection), in that order."""
        return QuantizedWeight(
            self.format,
            self.qweight[index].contiguous(),
            self.scales[index].contiguous(),
            None if self.mins is None else self.mins[index].contiguous(),
            self.group,
        )

    def as_int8(self, group: int, dtype: torch.dtype, with_mins: bool) -> QuantizedWeight:
        """The same weights, to the bit, with int8 values and `dtype` scales per `group` (which
        divides this one's), with minimums (zeros where this has none) or without (this has
        none): float16 scales and minimums are exact in float32, and repeated scales exact."""
        n, k = self.shape
        scales = self.scales.to(dtype).repeat_interleave(self.group // group, dim=1)
        mins = self.mins
        if with_mins:
            mins = torch.zeros(n, k // Q8_BLOCK, dtype=dtype) if mins is None else mins.to(dtype)
        elif mins is not None:
            raise ValueError("QuantizedWeight.as_int8: these weights have minimums")
        values = _values(self).to(torch.int8)
        return QuantizedWeight("int8", values, scales.contiguous(), mins, group)

    @staticmethod
    def can_cat(parts: list[QuantizedWeight]) -> bool:
        """Whether `cat` stacks these: the same format, scales, group and K."""
        first = parts[0]
        return all(
            (p.format, p.code, p.group, p.shape[1], p.mins is None)
            == (first.format, first.code, first.group, first.shape[1], first.mins is None)
            for p in parts
        )

    @staticmethod
    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """`cat` of parts with the same K in any formats (a fused qkv whose v is Q6_K or Q8_0 and
        whose q and k are Q4_K or Q5_0): parts that differ are brought, exactly, to the int8
        format that holds them all (`as_int8`): float16 scales where every part has them and no
        minimums, else float32 scales, per 16 weights where any part's are, with minimums where
        any part has them. A ValueError where no such format exists (groups that do not nest)."""
        if QuantizedWeight.can_cat(parts):
            return QuantizedWeight.cat(parts)
        with_mins = any(p.mins is not None for p in parts)
        if not with_mins and all(p.scales.dtype == torch.float16 for p in parts):
            group, dtype = min(p.group for p in parts), torch.float16
        else:
            group, dtype = min(16 if p.group % Q8_BLOCK else Q8_BLOCK for p in parts), torch.float32
        if any(p.group % group or p.shape[1] != parts[0].shape[1] for p in parts):
            raise ValueError("QuantizedWeight.stack: the parts' K or groups do not agree")
        return QuantizedWeight.cat([p.as_int8(group, dtype, with_mins) for p in parts])

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stacks weights with the same format, K and group along N (fused qkv / gate_up)."""
        first = parts[0]
        if not QuantizedWeight.can_cat(parts):
            raise ValueError("QuantizedWeight.cat: parts differ in format, group or K")
        mins = None if first.mins is None else torch.cat([p.mins for p in parts])
        return QuantizedWeight(
            first.format,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            first.group,
        )


def _check_group(k: int, group: int, name: str) -> None:
    if group <= 0 or k % group or group % 2:
        raise ValueError(f"{name}: group {group} must be even and divide K = {k}")


def quantize_int8(w: torch.Tensor, group: int | None = None) -> QuantizedWeight:
    """Symmetric int8, one scale per row (`group=None`) or per `group` columns."""
    n, k = w.shape
    group = k if group is None else group
    if k % group:
        raise ValueError(f"quantize_int8: group {group} must divide K = {k}")
    g = w.detach().float().reshape(n, k // group, group)
    scales = g.abs().amax(-1) / 127.0
    scales = torch.where(
        scales == 0, torch.ones_like(scales), scales
    ).half()  # q is rounded against these
    q = torch.round(g / scales.float()[..., None]).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedWeight("int8", q.contiguous(), scales.contiguous(), None, group)


def quantize_int4(w: torch.Tensor, group: int = 32) -> QuantizedWeight:
    """Asymmetric int4 per `group` columns (GGUF Q4_1's scheme: min and (max - min) / 15)."""
    n, k = w.shape
    _check_group(k, group, "quantize_int4")
    g = w.detach().float().reshape(n, k // group, group)
    lo = g.amin(-1).half()  # q is rounded against the float16 minimum and scale it is stored with
    scales = ((g.amax(-1) - lo.float()) / 15.0).half()
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).float()
    q = torch.round((g - lo.float()[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(
        "int4", pack_int4(q.reshape(n, k), group), scales.contiguous(), lo.contiguous(), group
    )


def pack_int4(q: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K // 2] bytes in the GGUF nibble order (see module doc)."""
    n, k = q.shape
    g = q.reshape(n, k // group, 2, group // 2).to(torch.uint8)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor, group: int) -> torch.Tensor:
    n, half_k = packed.shape
    g = packed.reshape(n, half_k * 2 // group, group // 2)
    return torch.stack([g & 0x0F, g >> 4], dim=2).reshape(n, half_k * 2)


def pack_int5(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..31 (K a multiple of 64) -> [N, K // 2 + K // 8] bytes: per 64 weights,
    32 bytes with weight j in the low nibble of byte j and weight j + 32 in the high one, every
    chunk's nibbles first, then each chunk's fifth bits, 8 bytes little-endian (see module doc)."""
    n, k = q.shape
    c = q.reshape(n, k // 64, 2, 32).to(torch.uint8)
    nibbles = (c[:, :, 0] & 0x0F) | ((c[:, :, 1] & 0x0F) << 4)
    bits = ((c.reshape(n, k // 64, 8, 8) >> 4) & 1) << torch.arange(8, dtype=torch.uint8)
    return torch.cat(
        [nibbles.reshape(n, k // 2), bits.sum(-1, dtype=torch.uint8).reshape(n, -1)], 1
    )


def unpack_int5(packed: torch.Tensor) -> torch.Tensor:
    """`pack_int5`'s bytes [N, K // 2 + K // 8] -> [N, K] values 0..31."""
    n, k = packed.shape[0], packed.shape[1] * 8 // 5
    nib = packed[:, : k // 2].reshape(n, k // 64, 1, 32)
    low = torch.cat([nib & 0x0F, nib >> 4], dim=2)  # [n, chunks, 2, 32]
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed[:, k // 2 :].reshape(n, k // 64, 8, 1) >> shifts) & 1  # [n, chunks, 8, 8]
    return (low.reshape(n, k // 64, 64) | (bits.reshape(n, k // 64, 64) << 4)).reshape(n, k)


def _values(qw: QuantizedWeight) -> torch.Tensor:
    """The integer values q * scale multiplies, [N, K]."""
    if qw.format == "int8":
        return qw.qweight
    if qw.format == "int4":
        return unpack_int4(qw.qweight, qw.group)
    q = unpack_int5(qw.qweight)
    return q if qw.mins is not None else q.to(torch.int8) - 16


def dequantize_ref(qw: QuantizedWeight, with_mins: bool = True) -> torch.Tensor:
    """The float32 [N, K] matrix a quantized weight stands for (`with_mins=False`: q * scale
    only)."""
    n, k = qw.shape
    values = _values(qw)
    q = values.float().reshape(n, k // qw.group, qw.group) * qw.scales.float()[..., None]
    if not with_mins or qw.mins is None:
        return q.reshape(n, k)
    return (q.reshape(n, k // Q8_BLOCK, Q8_BLOCK) + qw.mins.float()[..., None]).reshape(n, k)


def q8_activations(x: torch.Tensor, levels: int = 2) -> torch.Tensor:
    """x rounded as the decode kernel rounds it, in blocks of 32 along K with d = max|x| / 127:
    q1 = round(x / d), q2 = round((x / d - q1) * 128), both int8, x ~ d * (q1 + q2 / 128).
    `levels=1` stops at q1 (llama.cpp's rounding, for comparison)."""
    xb = x.float().reshape(*x.shape[:-1], -1, Q8_BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    t = xb * inv
    q1 = torch.round(t)
    if levels == 1:
        return (q1 * d).reshape(x.shape)
    q2 = torch.round((t - q1) * 128.0)
    return ((q1 * 128.0 + q2) * (d / 128.0)).reshape(x.shape)


def quant_matmul_ref(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, q8: bool = False
) -> torch.Tensor:
    """dequant(qw) applied to x; with `q8`, as the decode kernel computes it: x rounded by
    `q8_activations` meets q * scale, while the int4 minimum meets the exact x."""
    x = x.float()
    if not q8:
        y = x @ dequantize_ref(qw).t()
    else:
        y = q8_activations(x) @ dequantize_ref(qw, with_mins=False).t()
        if qw.mins is not None:
            y = y + x @ qw.mins.float().repeat_interleave(Q8_BLOCK, dim=1).t()
    return y if bias is None else y + bias
