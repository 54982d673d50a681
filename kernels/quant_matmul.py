"""Weight-only quantized linear layers: formats, quantizers, the torch reference and the native
CPU kernel (`csrc/cpu_quant_matmul.cpp`, which picks among its ISA tiers, `csrc/quant_matmul_*.cpp`,
and the float32 GEMV, `csrc/dense_gemv.cpp`).

Two formats, both grouped along the input dimension K, with float16 scales (and minimums), as
GGUF stores them:

- `int8`: symmetric, `w = q * scale`, q in [-127, 127]; one scale per row (per-channel, the
  default) or per group (GGUF Q8_0 is int8 with groups of 32).
- `int4`: asymmetric, `w = q * scale + min`, q in [0, 15], groups of 32 by default — the GGUF
  Q4_1 block, so a Q4_1 file loads without re-quantizing. Two weights per byte: in each group, byte
  j holds weight j (low nibble) and weight j + group/2 (high nibble), as in GGUF.

`quant_matmul(x, qw, bias)` runs the native kernel on CPU float32 inputs when it builds, and the
reference (dequantize, then matmul) elsewhere. For up to `q8_max_rows()` rows of x (on AVX2
machines fewer than `DEQUANT_GEMM_MIN_ROWS`: decode batches, short extends; with AVX-512 VNNI any
number, prefill chunks too), where K is a multiple of 32 (and int4 groups
are 32), it rounds x to int8 in blocks of 32 and multiplies with integer dot products, as
llama.cpp does, but in two levels (an int8 and an int8 remainder: exact to 1/256 of a step;
`q8_activations` is the reference). One level alone, llama.cpp's, changed 42% of SmolLM2's greedy
tokens against float activations on the same weights; two change none, for ~9% of int4 decode.
That ran 80-105 GMAC/s on 2 cores with SmolLM2's shapes for 5-47 rows, where the float tile path
below ran 37-90. Elsewhere, up to 4 rows of x are dotted with weights unpacked in registers, and
up to 47 rows, tiles of weight rows are dequantized in L1. On AVX2, from `DEQUANT_GEMM_MIN_ROWS`
rows (prefill chunks, compute-bound) x stays float32 (rounding it in one level ran prefill 1.3x
faster but raised SmolLM2's int4 perplexity on our text by 3%; in two levels it was no faster): the
matrix is dequantized into a scratch buffer for torch's float32 GEMM, except for very large
matrices (an LM head), which stay on the tile kernel.

GGUF's k-quants load as these formats with float32 scales (and minimums), never re-quantized:
their effective scale per 16 or 32 weights (the sub-block's 6- or 8-bit scale times the
superblock's float16 one) is exact in float32, not in float16. Q4_K is `int4` (its nibbles
reordered to the order above) with float32 scales and minimums; Q5_K `int8` (values 0..31) with
float32 scales and minimums per 32; Q6_K `int8` (values q - 32) with float32 scales per 16. Q5_0 is
plain `int8` with its float16 scales (values q - 16). `dequantize_ref` of each is
`gguf.quants.dequantize` of the file's blocks, bit for bit; the kernels read them at one
`format_code` each.

Where torch's bfloat16 GEMM runs on AMX tiles (Intel Xeon from Sapphire Rapids on; oneDNN) or
AVX-512 BF16 dot products (AMD Zen 4 and 5), from the tuning table's rows of x for this CPU kind
(`tuning.CPU_TUNING`, `cpu_kind()`; prefill chunks, scoring a prompt) the matrix is dequantized to
bfloat16 slice by slice and multiplied there instead (`bf16_matmul`): float32 accumulation, x, the
weights and the product rounded to bfloat16. `PLAIT_BF16_GEMM=0` turns that off, `=1` forces it on
any CPU (slow without AMX: for tests).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from plait import environment
from plait.kernels import native
from plait.kernels.tuning import (
    BF16_GEMM_MIN_ROWS,
    BF16_GEMM_SLICE,
    CPU_TUNING,
    DEQUANT_GEMM_MAX_ELEMENTS,
    DEQUANT_GEMM_MIN_ROWS,
    NO_TUNING,
    CpuTuning,
)

FORMATS = ("int8", "int4")
# (format, scale dtype) -> the kernel's format code (csrc/plait_kernels.h: PlaitWeightFormat);
# "float32" is plain weights, see `dense_matmul`
FORMAT_CODE = {"int8": 0, "int4": 1, "float32": 2, "int8-f32": 3, "int4-f32": 4}
Q8_BLOCK = 32  # decode rows round activations to int8 in blocks of this many (see `q8_activations`)
BF16_GEMM_ENV = environment.BF16_GEMM


@dataclass
class QuantizedWeight:
    """A [N, K] weight matrix in one of `FORMATS`."""

    format: str
    qweight: torch.Tensor  # int8 [N, K] or uint8 [N, K // 2]
    scales: torch.Tensor  # float16, or float32 (k-quants) [N, K // group]
    mins: (
        torch.Tensor | None
    )  # scales' dtype [N, K // group]: int4, and int8 with float32 scales (Q5_K)
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
        if self.mins is not None and self.format == "int8" and self.group != Q8_BLOCK:
            raise ValueError(
                f"QuantizedWeight: int8 mins need groups of {Q8_BLOCK}, got {self.group}"
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


def dequantize_ref(qw: QuantizedWeight, with_mins: bool = True) -> torch.Tensor:
    """The float32 [N, K] matrix a quantized weight stands for (`with_mins=False`: q * scale
    only)."""
    n, k = qw.shape
    values = qw.qweight if qw.format == "int8" else unpack_int4(qw.qweight, qw.group)
    q = values.float().reshape(n, k // qw.group, qw.group) * qw.scales.float()[..., None]
    return (q + qw.mins.float()[..., None] if with_mins and qw.mins is not None else q).reshape(
        n, k
    )


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
            y = y + x @ qw.mins.float().repeat_interleave(qw.group, dim=1).t()
    return y if bias is None else y + bias


@cache
def _kernels() -> tuple | None:
    ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    mm = native.function(
        "cpu_kernels",
        "plait_qmatmul_f32",
        [ptr, i64, i64, i64, ptr, c_int, i64, ptr, ptr, ptr, ptr, c_int],
    )
    if mm is None:
        return None
    dq = native.function(
        "cpu_kernels", "plait_dequantize_f32", [ptr, c_int, i64, i64, i64, ptr, ptr, ptr, c_int]
    )
    q8 = native.function("cpu_kernels", "plait_qmatmul_q8_rows", [i64, c_int, i64], c_int)
    q8_max = native.function("cpu_kernels", "plait_qmatmul_max_q8_rows", [], i64)
    dq16 = native.function(
        "cpu_kernels", "plait_dequantize_bf16", [ptr, c_int, i64, i64, i64, ptr, ptr, ptr, c_int]
    )
    set_task_rows(CPU_TUNING.get(_kind(_isa_name()), NO_TUNING).task_rows)
    return mm, dq, q8, q8_max(), dq16


def _isa_name() -> str:
    fn = native.function("cpu_kernels", "plait_qmatmul_isa", [], ctypes.c_int)
    return {2: "avx512-vnni", 1: "avx2"}.get(fn(), "portable")


def set_task_rows(table: tuple[tuple[int, int], ...]) -> None:
    """Gives the library a tuning table of weight rows per task (`tuning.CpuTuning.task_rows`:
    (rows of x at most, weight rows) pairs); `()` restores 16 rows at every M. Done once as the
    library loads; benchmarks and tests call it to compare tables."""
    fn = native.function(
        "cpu_kernels",
        "plait_qmatmul_set_task_rows",
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64],
    )
    max_m = (ctypes.c_int64 * max(1, len(table)))(*(m for m, _ in table))
    rows = (ctypes.c_int64 * max(1, len(table)))(*(r for _, r in table))
    fn(max_m, rows, len(table))


def task_rows(m: int, n: int, num_threads: int | None = None) -> int:
    """The weight rows per task the native multi-row kernels take for an [m, K] x [n, K] product."""
    fn = native.function(
        "cpu_kernels",
        "plait_qmatmul_task_rows",
        [ctypes.c_int64, ctypes.c_int64, ctypes.c_int],
        ctypes.c_int64,
    )
    return fn(m, n, num_threads or torch.get_num_threads())


def q8_max_rows() -> int:
    """The most rows of x the native kernel rounds to int8, as the library reports it: 47 on AVX2
    (decode batches and short extends; `native.abi_constant("avx2_max_q8_rows")`), every row count
    with AVX-512 VNNI (prefill chunks too), 0 without the kernels."""
    return _kernels()[3] if native_quant_available() else 0


def native_q8_rows(m: int, qw: QuantizedWeight) -> bool:
    """Whether the native kernel rounds x to int8 (`q8_activations`) for these `m` rows of x."""
    if m > q8_max_rows() or not native_quant_available():
        return False
    return bool(_kernels()[2](qw.shape[1], qw.code, qw.group))


def native_isa() -> str:
    """The instructions the native decode rows were built with: "avx512-vnni", "avx2", "portable"
    (no integer dot products: the float paths alone) or "none" (no native kernels)."""
    if not native_quant_available():
        return "none"
    return _isa_name()


def native_quant_available() -> bool:
    return not native.native_disabled() and _kernels() is not None


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_ref` (float32, or rounded to `dtype`), by the native kernel when it is
    available."""
    if (
        qw.qweight.device.type != "cpu"
        or not native_quant_available()
        or dtype not in (torch.float32, torch.bfloat16)
    ):
        return dequantize_ref(qw).to(dtype)
    n, k = qw.shape
    out = torch.empty(n, k, dtype=dtype)
    mins = 0 if qw.mins is None else qw.mins.data_ptr()
    _kernels()[1 if dtype == torch.float32 else 4](
        qw.qweight.data_ptr(),
        qw.code,
        n,
        k,
        qw.group,
        qw.scales.data_ptr(),
        mins,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def _amx_tiles() -> bool:
    try:  # the CPU has tiles, and the kernel lets this process use them (Linux 5.16 on)
        return bool(
            torch.backends.mkldnn.is_available()
            and torch.cpu._is_amx_tile_supported()
            and torch.cpu._init_amx()
        )
    except (AttributeError, RuntimeError):  # a torch without the probes
        return False


def _kind(isa: str) -> str:
    if _amx_tiles():
        return "amx"
    try:
        bf16 = torch.backends.mkldnn.is_available() and torch.cpu._is_avx512_bf16_supported()
    except AttributeError:
        bf16 = False
    return "avx512-bf16" if isa == "avx512-vnni" and bf16 else isa


@cache
def cpu_kind() -> str:
    """The kind of CPU the tuning table (`tuning.CPU_TUNING`) knows this one as: "amx" (torch's
    GEMM has AMX tiles this process may use), "avx512-bf16" (AVX-512 VNNI and BF16 without AMX:
    AMD Zen 4 and 5), else the native kernels' build (`native_isa()`)."""
    return _kind(native_isa())


def cpu_tuning() -> CpuTuning:
    """This CPU kind's entry of `tuning.CPU_TUNING`."""
    return CPU_TUNING.get(cpu_kind(), NO_TUNING)


@cache
def bf16_gemm_enabled() -> bool:
    """Whether prefill-shaped quantized matmuls run in bfloat16 (`bf16_matmul`): only with
    `PLAIT_BF16_GEMM=1`. Rounding x and each product to bfloat16 moves a model's logprobs enough
    to change its top-1 token at a few percent of positions (docs/cpu.md), so the faster GEMM is
    a choice the user makes, never the default."""
    return bool(environment.current().bf16_gemm)


def bf16_gemm_min_rows() -> int:
    """From how many rows of x `bf16_matmul` takes a product where it is enabled: the tuning
    table's crossover for this CPU kind, else `BF16_GEMM_MIN_ROWS`."""
    return max(BF16_GEMM_MIN_ROWS, cpu_tuning().bf16_gemm_min_rows or BF16_GEMM_MIN_ROWS)


def bf16_extends_enabled() -> bool:
    """Whether prefill chunks of models with quantized weights attend in bfloat16 as well: where
    their matmuls run in bfloat16 and the tuning table says so for this CPU kind (or
    `PLAIT_BF16_GEMM=1`)."""
    if not bf16_gemm_enabled():
        return False
    return environment.current().bf16_gemm is not None or cpu_tuning().bf16_extends


def bf16_matmul(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float32 @ dequant(qw).T (+ bias) -> float32 [M, N] on torch's bfloat16 GEMM: x and
    the weights rounded to bfloat16, sums in float32, each product rounded to bfloat16. The matrix
    is dequantized `BF16_GEMM_SLICE` elements at a time, so an LM head needs no full-size copy."""
    n, k = qw.shape
    xb = x.to(torch.bfloat16)
    step = max(1, BF16_GEMM_SLICE // k)
    if step >= n:
        y = torch.mm(xb, dequantize(qw, torch.bfloat16).t()).float()
    else:
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        for start in range(0, n, step):
            stop = min(n, start + step)
            y[:, start:stop] = torch.mm(
                xb, dequantize(qw.row_range(start, stop), torch.bfloat16).t()
            )
    return y if bias is None else y.add_(bias)


def quant_matmul(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ dequant(qw).T (+ bias) -> float32 [..., N]."""
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features, the weight expects {k}")
    if x.device.type != "cpu" or x.dtype != torch.float32 or not native_quant_available():
        return quant_matmul_ref(x, qw, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if m >= BF16_GEMM_MIN_ROWS and bf16_gemm_enabled() and m >= bf16_gemm_min_rows():
        return bf16_matmul(x2, qw, bias).reshape(*lead, n)
    if (
        m >= DEQUANT_GEMM_MIN_ROWS
        and n * k <= DEQUANT_GEMM_MAX_ELEMENTS
        and not native_q8_rows(m, qw)
    ):
        y = torch.nn.functional.linear(x2, dequantize(qw), bias)
        return y.reshape(*lead, n)
    return call_native_matmul(_kernels()[0], x2, qw, bias).reshape(*lead, n)


def call_native_matmul(
    fn: Any, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float32, contiguous, @ dequant(qw).T (+ bias) by `fn`, the native library's
    `plait_qmatmul_f32` (this process's, or another build's for `plait bench kernels`)."""
    (m, k), n = x.shape, qw.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        mins = 0 if qw.mins is None else qw.mins.data_ptr()
        bias = None if bias is None else bias.contiguous()  # held while the kernel reads it
        fn(
            x.data_ptr(),
            m,
            k,
            n,
            qw.qweight.data_ptr(),
            qw.code,
            qw.group,
            qw.scales.data_ptr(),
            mins,
            0 if bias is None else bias.data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        )
    return y


def dense_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear for float32 weights, by the native kernel on the CPU for fewer than
    `DEQUANT_GEMM_MIN_ROWS` rows of x (torch's GEMV read the weights at 16-36 GB/s on a 2-core VM
    where the kernel, streaming two weight rows at a time, measured 37-49 GB/s on one thread), and
    for any number of rows of a matrix over `DEQUANT_GEMM_MAX_ELEMENTS` (an LM head scoring a prompt
    or `select` options: 80-85 GMAC/s against torch's 32-72 for SmolLM2's from 48 to 512 rows)."""
    n, k = weight.shape
    m = x.numel() // k if k else 0
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or m == 0
        or (m >= DEQUANT_GEMM_MIN_ROWS and n * k <= DEQUANT_GEMM_MAX_ELEMENTS)
        or not weight.is_contiguous()
        or not native_quant_available()
    ):
        return torch.nn.functional.linear(x, weight, bias)
    x2 = x.reshape(m, k).contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    bias = None if bias is None else bias.contiguous()  # held while the kernel reads it
    _kernels()[0](
        x2.data_ptr(),
        m,
        k,
        n,
        weight.data_ptr(),
        FORMAT_CODE["float32"],
        k,
        0,
        0,
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y.reshape(*x.shape[:-1], n)
