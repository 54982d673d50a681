"""Weight-only quantized linear layers on the CPU: the native kernel
(`csrc/cpu_quant_matmul.cpp`, which picks among its ISA tiers, `csrc/quant_matmul_*.cpp`, and the
float32 GEMV, `csrc/dense_gemv.cpp`) and which path a product takes. The formats, the quantizers
and the torch reference are in `quant_weights.py`.

`QuantMatmul(qw)` settles once, for one weight, what the machine and the block type decide (the
native kernel where it builds and the weight is on the CPU, the reference, dequantize then matmul,
elsewhere) and binds the native kernel it calls; each product then picks a path by its rows of x
alone. `quant_matmul(x, qw, bias)` is one product through a fresh `QuantMatmul`. For up to
`q8_max_rows()` rows of x (on AVX2 machines fewer than `DEQUANT_GEMM_MIN_ROWS`: decode batches,
short extends; with AVX-512 VNNI any number, prefill chunks too), where K is a multiple of 32 (and
int4 groups are 32), it rounds x to int8 in blocks of 32 and multiplies with integer dot products,
as llama.cpp does, but in two levels (an int8 and an int8 remainder: exact to 1/256 of a step;
`quant_weights.q8_activations` is the reference). One level alone, llama.cpp's, changes a large
share of greedy tokens against float activations on the same weights; two keep them, at a small cost
to int4 decode. For those rows the integer dot products run faster than the float tile path below.
Elsewhere, up to 4 rows of x are dotted with weights unpacked in registers, and up to 47 rows, tiles
of weight rows are dequantized in L1. On AVX2, from `DEQUANT_GEMM_MIN_ROWS` rows (prefill chunks,
compute-bound) x stays float32 (rounding it in one level speeds prefill but raises int4 perplexity;
in two levels it gains nothing over the GEMM): the matrix is dequantized into a scratch buffer for
torch's float32 GEMM, except for very large matrices (an LM head), which stay on the tile kernel.

Where torch's bfloat16 GEMM runs on AMX tiles (Intel Xeon from Sapphire Rapids on; oneDNN) or
AVX-512 BF16 dot products (AMD Zen 4 and 5), from the tuning table's rows of x for this CPU kind
(`tuning.CPU_TUNING`, `cpu_kind()`; prefill chunks, scoring a prompt) the matrix is dequantized to
bfloat16 slice by slice and multiplied there instead (`bf16_matmul`): float32 accumulation, x, the
weights and the product rounded to bfloat16. `PLAIT_BF16_GEMM=0` turns that off, `=1` forces it on
any CPU (slow without AMX: for tests).
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import torch

from plait import environment
from plait.kernels import native
from plait.kernels.quant_weights import (
    FORMAT_CODE,
    QuantizedWeight,
    dequantize_ref,
    quant_matmul_ref,
)
from plait.kernels.tuning import (
    BF16_GEMM_MIN_ROWS,
    BF16_GEMM_SLICE,
    CPU_TUNING,
    DEQUANT_GEMM_MAX_ELEMENTS,
    DEQUANT_GEMM_MIN_ROWS,
    NO_TUNING,
    CpuTuning,
)

BF16_GEMM_ENV = environment.BF16_GEMM


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


def native_isa() -> str:
    """The instructions the native decode rows were built with: "avx512-vnni", "avx2", "portable"
    (no integer dot products: the float paths alone) or "none" (no native kernels)."""
    if not native_quant_available():
        return "none"
    return _isa_name()


def native_quant_available() -> bool:
    return not native.native_disabled() and _kernels() is not None


def native_on(device: torch.device) -> bool:
    """Whether weights on `device` take the native kernels: the CPU, where they are built."""
    return device.type == "cpu" and native_quant_available()


def describe_paths(native_kernels: bool) -> str:
    """What `Engine.stats()["execution_quantized_matmul"]` says of quantized products: the
    reference without the native kernels, else the tier they were built with (`native_isa`)."""
    if not native_kernels:
        return "torch reference (dequantize, then matmul)"
    isa = native_isa()
    if isa == "portable":
        return "native, float activations against weights unpacked in registers"
    rows = "any number of rows" if isa == "avx512-vnni" else f"up to {q8_max_rows()} rows"
    return (
        f"native {isa}: activations rounded to int8 in two levels for {rows}, integer dot products"
    )


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_ref` (float32, or rounded to `dtype`), by the native kernel when it is
    available."""
    if not native_on(qw.qweight.device) or dtype not in (torch.float32, torch.bfloat16):
        return dequantize_ref(qw).to(dtype)
    return dequantize_native(qw, dtype)


def dequantize_native(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize` by the native kernel, for a caller that settled it applies (`native_on` the
    weight's device; float32 or bfloat16)."""
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


class QuantMatmul:
    """Products with one quantized weight, by paths chosen once for it (a `QuantLinear` builds
    one when its buffers are placed): the torch reference off the CPU or without the native
    library; on it, per number of rows m of x, the bfloat16 GEMM (`bf16_matmul`, where enabled,
    from the tuning table's rows), torch's float32 GEMM on the dequantized matrix (from
    `DEQUANT_GEMM_MIN_ROWS` rows of a matrix of at most `DEQUANT_GEMM_MAX_ELEMENTS`, unless the
    kernel rounds those rows to int8), else the native kernel. Activations of any float dtype
    are multiplied in float32; the product is float32."""

    def __init__(self, qw: QuantizedWeight) -> None:
        self.qw = qw
        n, k = qw.shape
        self.native = native_on(qw.qweight.device)
        q8 = self.native and bool(_kernels()[2](k, qw.code, qw.group))
        self.q8_max_rows = q8_max_rows() if q8 else 0  # x rounded to int8 up to this many rows
        self.bf16_min_rows = bf16_gemm_min_rows() if self.native and bf16_gemm_enabled() else None
        self.dequant_gemm = n * k <= DEQUANT_GEMM_MAX_ELEMENTS
        # the native library's `plait_qmatmul_f32`, where this weight takes it
        self._kernel = _kernels()[0] if self.native else None

    def rounds_to_int8(self, m: int) -> bool:
        """Whether the native kernel rounds these `m` rows of x to int8 (`q8_activations`)."""
        return 0 < m <= self.q8_max_rows

    def path(self, m: int) -> str:
        """The path m rows of x take: "reference", "bf16 GEMM", "float GEMM" (torch's, on the
        dequantized matrix), "int8 x" (the integer kernels) or "float x" (the float tiles)."""
        if not self.native:
            return "reference"
        if self.bf16_min_rows is not None and m >= self.bf16_min_rows:
            return "bf16 GEMM"
        if self.rounds_to_int8(m):
            return "int8 x"
        return "float GEMM" if m >= DEQUANT_GEMM_MIN_ROWS and self.dequant_gemm else "float x"

    def describe(self) -> str:
        """The paths this weight's products take, as `Engine.stats()` reports them
        (`describe_paths`)."""
        return describe_paths(self.native)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ dequant(qw).T (+ bias) -> float32 [..., N]."""
        qw = self.qw
        n, k = qw.shape
        if x.shape[-1] != k:
            raise ValueError(f"quant_matmul: x has {x.shape[-1]} features, the weight expects {k}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k).float().contiguous()
        path = self.path(x2.shape[0])
        if path == "reference":
            y = quant_matmul_ref(x2, qw, bias)
        elif path == "bf16 GEMM":
            y = bf16_matmul(x2, qw, bias)
        elif path == "float GEMM":
            y = torch.nn.functional.linear(x2, dequantize_native(qw), bias)
        else:
            y = call_native_matmul(self._kernel, x2, qw, bias)
        return y.reshape(*lead, n)


def quant_matmul(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ dequant(qw).T (+ bias) -> float32 [..., N], by the paths `QuantMatmul`
    chooses for `qw` (here for this one product; layers hold their `QuantMatmul`)."""
    return QuantMatmul(qw)(x, bias)


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
    `DEQUANT_GEMM_MIN_ROWS` rows of x (the kernel, reading each weight row in one sequential pass
    with the rows ahead prefetched, reads the weights faster than torch's GEMV does), and for any
    number of rows of a matrix over `DEQUANT_GEMM_MAX_ELEMENTS` (an LM head scoring a prompt or
    `select` options, where the kernel's tiles also outrun torch's GEMM)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not native_quant_available():
        return torch.nn.functional.linear(x, weight, bias)
    return native_dense_matmul(x, weight, bias)


def native_dense_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`dense_matmul` for float32 CPU activations where the native library is built (a caller
    that settled that once, `layer_ops.NativeCpuOps`): the native kernel for the rows and
    matrices `dense_matmul` names, torch's GEMM for the rest."""
    n, k = weight.shape
    m = x.numel() // k if k else 0
    if (
        weight.dtype != torch.float32
        or m == 0
        or (m >= DEQUANT_GEMM_MIN_ROWS and n * k <= DEQUANT_GEMM_MAX_ELEMENTS)
        or not weight.is_contiguous()
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
