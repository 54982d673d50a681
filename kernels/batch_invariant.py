"""Products whose every row is what that row alone gets, whatever else is in the batch.

The engine's `deterministic` mode runs a model's linears and LM head through `matmul_rows`: a
row's logits then do not depend on which requests share its step (batch-invariant inference, as
vLLM's and SGLang's deterministic modes call it). The default paths change with the number of rows
(an integer GEMV for a few rows, a dequantized or bfloat16 GEMM for a prefill chunk), so the same
prompt scored alone and in a batch differs in its last bits, sometimes more.

The native `plait_qmatmul_rows_f32` takes the integer rows at every row count (each row rounded to
int8 and summed on its own), float32 weights in one summation order, and other formats one row of
x at a time; without the native library, torch multiplies one row at a time.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import torch

from plait.kernels import native
from plait.kernels.quant_matmul import call_native_matmul, native_quant_available
from plait.kernels.quant_weights import FORMAT_CODE, QuantizedWeight, quant_matmul_ref


@cache
def _kernel() -> Any:
    ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return native.function(
        "cpu_kernels",
        "plait_qmatmul_rows_f32",
        [ptr, i64, i64, i64, ptr, c_int, i64, ptr, ptr, ptr, ptr, c_int],
    )


def matmul_rows(
    x: torch.Tensor, weight: QuantizedWeight | torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> float32 [..., N], W quantized blocks or a float32 [N, K]
    matrix, each row of the result independent of the other rows of x."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"matmul_rows: x has {x.shape[-1]} features, the weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).float().contiguous()
    native_ok = x2.device.type == "cpu" and native_quant_available() and _kernel() is not None
    if isinstance(weight, QuantizedWeight):
        if native_ok:
            y = call_native_matmul(_kernel(), x2, weight, bias)
        else:
            y = _one_row_at_a_time(x2, n, lambda row: quant_matmul_ref(row, weight, bias))
        return y.reshape(*lead, n)
    w = weight.float().contiguous()
    b = None if bias is None else bias.float().contiguous()  # held: the kernel reads its memory
    if native_ok:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        if x2.shape[0]:
            _kernel()(
                x2.data_ptr(),
                x2.shape[0],
                k,
                n,
                w.data_ptr(),
                FORMAT_CODE["float32"],
                k,
                0,
                0,
                0 if b is None else b.data_ptr(),
                y.data_ptr(),
                torch.get_num_threads(),
            )
    else:
        y = _one_row_at_a_time(x2, n, lambda row: torch.nn.functional.linear(row, w, b))
    return y.reshape(*lead, n)


def _one_row_at_a_time(x: torch.Tensor, n: int, fn: Any) -> torch.Tensor:
    rows = [fn(x[i : i + 1]).float() for i in range(x.shape[0])]
    return torch.cat(rows) if rows else x.new_empty(0, n)
