"""The kernels' tuning constants: each is a crossover between two implementations of the same
result, set where measurements on SmolLM2's shapes put it. None changes what is computed beyond
float rounding; each changes which path computes it. The modules that use them import them from
here (tests patch them there, on the module that reads them).

Constants the native library fixes at build time (its formats, the rows it rounds to int8) are
not here: the library exports them (`native.abi_constant`, `quant_matmul.q8_max_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Quantized and dense matmuls (quant_matmul.py) ----------------------------------------------------

# From this many rows of x (prefill chunks), a quantized matrix is dequantized once for torch's
# float32 GEMM, which is compute-bound there, instead of the native kernel; fewer rows (decode
# batches, short extends) stay native, where reading the weights once as int8/int4 wins. It sits
# right past the most rows the AVX2 kernel rounds to int8 (47, exported by the library), and the
# native decode stack takes batches below it.
DEQUANT_GEMM_MIN_ROWS = 48
# Matrices with more elements than this (an LM head) stay on the native tile kernel at any row
# count: a dequantized float32 copy would cost more memory traffic than the GEMM saves.
DEQUANT_GEMM_MAX_ELEMENTS = 8 << 20


@dataclass(frozen=True)
class CpuTuning:
    """How quantized matmuls run on one kind of CPU (`quant_matmul.cpu_kind()`), measured there
    with `plait bench kernels` (docs/cpu.md, "The tuning table") and chosen once per process.

    - `bf16_gemm_min_rows`: from this many rows of x (prefill chunks), the matrix is dequantized to
      bfloat16 slice by slice for torch's bfloat16 GEMM (`quant_matmul.bf16_matmul`), where that
      GEMM runs on AMX tiles or AVX-512 BF16 dot products faster than the integer kernels; None:
      never.
    - `bf16_extends`: prefill chunks of models with quantized weights also attend in bfloat16.
    - `task_rows`: weight rows per task of the native multi-row integer kernels, as (rows of x at
      most, weight rows) pairs by increasing rows of x, the last pair for every larger count. A
      task's weight rows stay in cache while every tile of x passes over them, and x is read from
      L2 (or memory) once per task: small batches want small tasks (many to share among the
      threads), many rows of x larger ones. The library takes the table as it loads; the kernel
      shrinks a task so that N splits evenly over the threads. Empty: 16 rows at every M.
    """

    bf16_gemm_min_rows: int | None
    bf16_extends: bool
    task_rows: tuple[tuple[int, int], ...]


_VNNI_TASK_ROWS = ((16, 16), (64, 32), (1 << 40, 128))
CPU_TUNING: dict[str, CpuTuning] = {
    # Intel Xeon from Sapphire Rapids on: torch's bfloat16 GEMM on AMX tiles; the integer kernels
    # are the AVX-512 VNNI ones (their task rows are the EPYC's, not measured on such a CPU)
    "amx": CpuTuning(bf16_gemm_min_rows=48, bf16_extends=True, task_rows=_VNNI_TASK_ROWS),
    # AMD Zen 4 and 5 (and Intel Cooper Lake): AVX-512 BF16 dot products in torch's GEMM run the
    # projections faster than the integer kernels from a few dozen rows of x
    "avx512-bf16": CpuTuning(bf16_gemm_min_rows=64, bf16_extends=False, task_rows=_VNNI_TASK_ROWS),
    "avx512-vnni": CpuTuning(
        bf16_gemm_min_rows=None, bf16_extends=False, task_rows=_VNNI_TASK_ROWS
    ),
    "avx2": CpuTuning(bf16_gemm_min_rows=None, bf16_extends=False, task_rows=()),
}
NO_TUNING = CpuTuning(bf16_gemm_min_rows=None, bf16_extends=False, task_rows=())  # any other CPU
# The fewest rows of x any CPU kind sends to the bfloat16 GEMM (`CpuTuning.bf16_gemm_min_rows`),
# and where `PLAIT_BF16_GEMM=1` sends them on any CPU.
BF16_GEMM_MIN_ROWS = DEQUANT_GEMM_MIN_ROWS
# Weight elements dequantized to bfloat16 at a time by `bf16_matmul` (8 MB of scratch): smaller
# slices cost more GEMM calls, larger ones a bigger copy for an LM head.
BF16_GEMM_SLICE = 4 << 20

# Attention on the CPU (attention_cpu.py, attention.py) --------------------------------------------

# An extend with at most this many new tokens (speculative verification, jump-forward) runs as
# attention rows over its slots in place; longer ones gather their context for blocked kernels,
# whose matmuls win once a sequence brings many query tokens.
MAX_ROW_EXTEND = 16
# Where the model runs its prefill in bfloat16 (quantized weights on AMX CPUs), an extend attends in
# bfloat16 from this many new tokens, once new tokens x keys reach BF16_EXTEND_MIN_WORK; below,
# converting the operands costs more than the tiles save and the float32 kernel is faster.
BF16_EXTEND_MIN_Q = 16
BF16_EXTEND_MIN_WORK = 20_000

# Triton attention (paged_kv_triton.py, decode_attention_triton.py, extend_attention_triton.py) ----

# Decode attention splits each context (split-K) into enough (batch, KV head, split) programs to
# fill the GPU DECODE_SPLIT_OCCUPANCY times over, but no split shorter than DECODE_SPLIT_MIN_TOKENS
# (each split adds a partial output to merge) and at most DECODE_MAX_SPLITS.
DECODE_SPLIT_MIN_TOKENS = 256
DECODE_SPLIT_OCCUPANCY = 2
DECODE_MAX_SPLITS = 64
# Keys per block of the decode kernel, and query x key tiles of the extend kernel: larger tiles
# reuse each load more, at more registers and shared memory per program.
DECODE_BLOCK_N = 64
EXTEND_BLOCK_M = 64
EXTEND_BLOCK_N = 64

# Triton (constraint_mask.py, sampling_triton.py) --------------------------------------------------

# Vocabulary entries per program of the bitmask kernel: one load of 32 mask words per 1,024 logits.
MASK_BLOCK_SIZE = 1024
# Vocabulary entries per program of the sampling kernel, and the pivots its top-k / top-p
# threshold search tries per pass (more pivots: fewer passes over the logits, more work per pass).
SAMPLE_BLOCK_V = 1024
SAMPLE_NUM_PIVOTS = 8

# Rows of x per block of the MLP on the CPU (`layer_ops.LayerOps.block_rows`): long prefills run
# it block by block so that the [rows, 2 x intermediate] activations stay small (memory, cache),
# at one more call per block.
CPU_MLP_ROWS = 2048
