"""Batch-invariant kernels (`kernels/batch_invariant.py`, the rows kernel's `invariant` split): a
row's result is the same to the bit alone and inside batches of every size, past the row counts
where the default paths change (47 rows on AVX2, 48 for a dequantized GEMM, 64 for bfloat16), for
every weight format; and it stays the product the reference computes (the tolerance of
`test_quant_matmul_kquants.py`: float32 summation order only)."""

from __future__ import annotations

import pytest
import torch

from plait.kernels import attention_cpu
from plait.kernels import quant_matmul as qm
from plait.kernels.attention import paged_attention_ref
from plait.kernels.batch_invariant import matmul_rows
from plait.kernels.quant_weights import (
    QuantizedWeight,
    dequantize_ref,
    quant_matmul_ref,
    quantize_int4,
    quantize_int8,
)
from plait.runtime.model_loader.gguf_blocks import quantized_blocks
from tests.unit.attention_cases import Case, make_batch, tolerance
from tests.unit.test_quant_matmul_kquants import BLOCK_TYPES, gguf_blocks

needs_native = pytest.mark.skipif(
    not qm.native_quant_available(), reason="native CPU kernels did not build"
)
ROWS = (1, 2, 5, 17, 47, 48, 64, 100)


def _weights(kind: str, n: int, k: int) -> QuantizedWeight | torch.Tensor:
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.1
    if kind == "float32":
        return w
    if kind == "int8":
        return quantize_int8(w, 64)
    if kind == "int4":
        return quantize_int4(w, 32)
    return quantized_blocks(kind, gguf_blocks(kind, n, k, seed=n), n, k)


@needs_native
@pytest.mark.parametrize("kind", ["float32", "int8", "int4", *BLOCK_TYPES])
def test_a_rows_result_is_the_same_in_batches_of_every_size(kind: str) -> None:
    n, k = 45, 512
    w = _weights(kind, n, k)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(max(ROWS), k, generator=gen)
    bias = torch.randn(n, generator=gen)
    alone = torch.cat([matmul_rows(x[i : i + 1], w, bias) for i in range(x.shape[0])])
    for m in ROWS:
        assert torch.equal(matmul_rows(x[:m], w, bias), alone[:m]), f"{m} rows"
    assert torch.equal(matmul_rows(x.flip(0), w, bias), alone.flip(0))  # wherever it sits
    if kind == "float32":
        torch.testing.assert_close(alone, x @ w.t() + bias, rtol=1e-5, atol=1e-5)
        return
    expected = quant_matmul_ref(x, w, bias, q8=qm.QuantMatmul(w).rounds_to_int8(1))
    magnitude = x.abs() @ dequantize_ref(w).abs().t() + bias.abs()
    assert ((alone - expected).abs() <= 2e-4 * expected.abs() + 1e-5 * magnitude).all()


def test_matmul_rows_names_a_mismatched_input() -> None:
    with pytest.raises(ValueError, match="x has 3 features, the weight expects 4"):
        matmul_rows(torch.zeros(2, 3), torch.zeros(5, 4))


@pytest.mark.skipif(
    not attention_cpu.native_attention_available(), reason="native CPU kernels did not build"
)
def test_attention_rows_split_each_row_by_its_own_length() -> None:
    # long extends are rows too; contexts past the fixed split (256 slots) merge several chunks
    case = Case(extends=[(300, 40), (0, 20)], decodes=[700, 5, 260], page_size=4)
    q, k, v, k_cache, v_cache, meta, _ = make_batch(case, seed=5)
    meta.batch_invariant = True
    scale = case.head_dim**-0.5
    expected = paged_attention_ref(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale)
    out = attention_cpu.paged_attention_cpu(q, k, v, k_cache, v_cache, meta, scale)
    rows = meta.cpu
    assert rows.invariant and rows.row_extends == {0, 1}
    assert rows.q_index.shape[0] == q.shape[0]  # every token a row
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    k_flat = k_cache.view(-1, case.num_kv_heads, case.head_dim)
    v_flat = v_cache.view(-1, case.num_kv_heads, case.head_dim)
    # each row alone, then every other row together: the same bits as in the whole batch
    for pick in [[i] for i in range(0, q.shape[0], 7)] + [list(range(0, q.shape[0], 2))]:
        index = torch.tensor(pick)
        subset = attention_cpu.CpuRows(
            rows.tables,
            rows.q_index[index],
            rows.table_index[index],
            rows.first[index],
            rows.kv_len[index],
            rows.row_extends,
            rows.window,
            True,
        )
        part = torch.zeros_like(out)
        attention_cpu.attention_rows(q.contiguous(), k_flat, v_flat, subset, part, scale)
        assert torch.equal(part[rows.q_index[index]], out[rows.q_index[index]]), pick
