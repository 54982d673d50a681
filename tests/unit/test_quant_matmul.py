"""Weight-only quantization: the formats round-trip within half a step, the native CPU kernel
equals the dequantize-then-matmul reference at decode and prefill sizes, and GGUF blocks load
without re-quantizing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plait import environment
from plait.kernels import quant_matmul as qm
from plait.kernels.quant_matmul import dequantize, quant_matmul
from plait.kernels.quant_weights import (
    QuantizedWeight,
    dequantize_ref,
    pack_int4,
    q8_activations,
    quant_matmul_ref,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def test_int8_per_channel_error_is_at_most_half_a_step() -> None:
    w = torch.randn(37, 96, generator=torch.Generator().manual_seed(0))
    qw = quantize_int8(w)
    assert qw.qweight.dtype == torch.int8 and qw.scales.shape == (37, 1) and qw.group == 96
    err = (dequantize_ref(qw) - w).abs()
    assert torch.all(err <= qw.scales / 2 + 1e-6)
    assert (
        qw.scales.dtype == torch.float16 and qw.nbytes == 37 * 96 + 37 * 2
    )  # float16 scales, as GGUF's


def test_int4_group_error_is_at_most_half_a_step_and_packing_round_trips() -> None:
    w = torch.randn(10, 128, generator=torch.Generator().manual_seed(1)) * 3
    qw = quantize_int4(w, group=32)
    assert qw.qweight.shape == (10, 64) and qw.scales.shape == (10, 4)
    assert (
        qw.scales.dtype == qw.mins.dtype == torch.float16 and qw.nbytes == 10 * 64 + 2 * 10 * 4 * 2
    )
    err = (dequantize_ref(qw) - w).abs().reshape(10, 4, 32)
    assert torch.all(err <= qw.scales[..., None] / 2 + 1e-5)
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q, 32), 32), q)
    # GGUF order: byte j of a group holds weight j (low nibble) and j + 16 (high nibble)
    assert pack_int4(q, 32)[0, 0].item() == q[0, 0].item() | (q[0, 16].item() << 4)


def test_constant_rows_quantize_to_their_value() -> None:
    w = torch.zeros(4, 64)
    w[1] = 2.5
    torch.testing.assert_close(dequantize_ref(quantize_int4(w)), w)  # scale 0, the minimum holds it
    # int8: 127 steps of a float16 scale, 2.5 / 127 to float16's precision (2^-11)
    torch.testing.assert_close(dequantize_ref(quantize_int8(w)), w, atol=0, rtol=2**-11)


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="group"):
        quantize_int4(torch.randn(4, 48), group=32)
    with pytest.raises(ValueError, match="features"):
        quant_matmul(torch.randn(2, 10), quantize_int8(torch.randn(4, 12)))
    with pytest.raises(ValueError, match="format"):
        QuantizedWeight.cat([quantize_int8(torch.randn(4, 64)), quantize_int4(torch.randn(4, 64))])
    good = quantize_int4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="scales must be float16 or float32"):
        QuantizedWeight("int4", good.qweight, good.scales.double(), good.mins, 32)
    with pytest.raises(ValueError, match="mins must be torch.float16"):
        QuantizedWeight("int4", good.qweight, good.scales, good.mins.float(), 32)


needs_native = pytest.mark.skipif(
    not qm.native_quant_available(), reason="native CPU kernels did not build"
)


# k / 32 groups: 3, 5, 1, then 18 (two runs of eight and a pair), 19 (and an odd one), 9 (eight and
# one), 2, 16, 12 (eight and four) and 6 (four and a pair: the 512-bit int4 rows take four groups at
# a time); n: single-row int4 sums eight rows at a time, so 45 and 21 leave rows over in a task
SHAPES = [
    (64, 96),
    (37, 160),
    (6, 32),
    (40, 576),
    (33, 608),
    (9, 288),
    (45, 64),
    (21, 512),
    (19, 384),
    (11, 192),
]
# int8 in groups of 96 (where a pair of 32-blocks may straddle two groups) needs k a multiple of 96
FORMAT_SHAPES = [
    (fmt, n, k)
    for fmt in ("int8", "int8-g32", "int8-g96", "int4")
    for n, k in SHAPES
    if fmt != "int8-g96" or k % 96 == 0
]


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 8, 16, 17, qm.DEQUANT_GEMM_MIN_ROWS, 100])
@pytest.mark.parametrize("fmt,n,k", FORMAT_SHAPES)
def test_native_kernel_matches_reference(fmt: str, m: int, n: int, k: int, monkeypatch) -> None:
    monkeypatch.setattr(
        qm, "bf16_gemm_enabled", lambda: False
    )  # AMX machines: see the bfloat16 tests
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    qw = {
        "int8": lambda: quantize_int8(w),
        "int8-g32": lambda: quantize_int8(w, 32),
        "int8-g96": lambda: quantize_int8(w, 96),
        "int4": lambda: quantize_int4(w),
    }[fmt]()
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    q8 = qm.QuantMatmul(qw).rounds_to_int8(m)
    # AVX2 machines round x for every row count short of a prefill's, AVX-512 VNNI ones for all
    assert q8 == (k % 32 == 0 and m <= qm.q8_max_rows()) or not q8
    assert qm.q8_max_rows() in (0, qm.DEQUANT_GEMM_MIN_ROWS - 1) or qm.native_isa() == "avx512-vnni"
    expected = quant_matmul_ref(x, qw, bias, q8=q8)
    torch.testing.assert_close(quant_matmul(x, qw, bias), expected, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(quant_matmul(x, qw), expected - bias, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(dequantize(qw), dequantize_ref(qw))
    # rounding x to int8 adds far less error than int4 weights carry; as much as int8 weights do
    exact = x @ w.t() + bias
    weight_error = (quant_matmul_ref(x, qw, bias) - exact).abs().mean()
    share = 0.4 if fmt == "int4" else 2.5
    assert (expected - quant_matmul_ref(x, qw, bias)).abs().mean() < share * weight_error + 1e-6


@needs_native
@pytest.mark.parametrize("fmt,n,k", FORMAT_SHAPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(fmt: str, n: int, k: int) -> None:
    # a decode burst keeps computing a row that stopped, so the rows beside a request differ from
    # one step at a time: seeded sampling gives the same tokens only if each row's logits do not
    # depend on its batch (bit for bit)
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    qw = {
        "int8": lambda: quantize_int8(w),
        "int8-g32": lambda: quantize_int8(w, 32),
        "int8-g96": lambda: quantize_int8(w, 96),
        "int4": lambda: quantize_int4(w),
    }[fmt]()
    x = torch.randn(32, k, generator=gen)
    alone = torch.cat([quant_matmul(x[i : i + 1], qw) for i in range(32)])
    for m in (2, 3, 5, 8, 9, 16, 17, 32):
        assert torch.equal(quant_matmul(x[:m], qw), alone[:m]), f"{m} rows"


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_tuning_table_changes_no_result(fmt: str) -> None:
    # the table sets how many weight rows a task takes; every row's sum stays in the same order
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(200, 576, generator=gen)
    qw = quantize_int8(w) if fmt == "int8" else quantize_int4(w)
    x = torch.randn(40, 576, generator=gen)
    expected = quant_matmul(x, qw)
    try:
        for table in ((), ((8, 16), (1 << 40, 128)), ((1 << 40, 40),)):
            qm.set_task_rows(table)
            assert torch.equal(quant_matmul(x, qw), expected), table
            assert all(qm.task_rows(m, 200, t) % 16 == 0 for m in (1, 40) for t in (1, 2, 3))
    finally:
        qm.set_task_rows(qm.cpu_tuning().task_rows)


def _bf16_reference(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """What `bf16_matmul` computes, summed in float32 by torch: x and the weights in bfloat16."""
    y = (x.bfloat16().float() @ dequantize_ref(qw).bfloat16().float().t()).bfloat16().float()
    return y if bias is None else y + bias


@pytest.mark.parametrize("fmt", ["int8", "int8-g32", "int4"])
def test_bf16_gemm_rows_round_x_and_weights_to_bfloat16(fmt: str, monkeypatch) -> None:
    """From BF16_GEMM_MIN_ROWS rows, where it is on (AMX; forced on here, so any CPU runs it),
    prefill-shaped products run on torch's bfloat16 GEMM: within a bfloat16 rounding of the product
    of the rounded operands, and far closer to the exact product than the int4 weights are."""
    monkeypatch.setattr(qm, "bf16_gemm_enabled", lambda: True)
    monkeypatch.setattr(qm, "bf16_gemm_min_rows", lambda: qm.BF16_GEMM_MIN_ROWS)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 576, generator=gen)
    qw = {
        "int8": lambda: quantize_int8(w),
        "int8-g32": lambda: quantize_int8(w, 32),
        "int4": lambda: quantize_int4(w),
    }[fmt]()
    x, bias = (
        torch.randn(qm.BF16_GEMM_MIN_ROWS + 5, 576, generator=gen),
        torch.randn(200, generator=gen),
    )
    expected = _bf16_reference(x, qw, bias)
    scale = (x.abs() @ dequantize_ref(qw).abs().t()).amax()
    y = quant_matmul(x.reshape(1, -1, 576), qw, bias).reshape(-1, 200)
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=float(scale) * 2**-12)
    exact = quant_matmul_ref(x, qw, bias)
    weight_error = (exact - (x @ w.t() + bias)).abs().mean()
    assert (y - exact).abs().mean() < (0.2 if fmt == "int4" else 1.0) * weight_error
    if qm.native_quant_available():  # fewer rows stay on the native kernel
        few = x[: qm.BF16_GEMM_MIN_ROWS - 1]
        torch.testing.assert_close(
            quant_matmul(few, qw),
            quant_matmul_ref(few, qw, q8=qm.QuantMatmul(qw).rounds_to_int8(len(few))),
            atol=2e-4,
            rtol=2e-4,
        )


@needs_native  # without the native kernels, plait runs the float32 references
def test_bf16_gemm_dequantizes_a_large_matrix_slice_by_slice(monkeypatch) -> None:
    """An LM head is dequantized a slice of rows at a time (no full-size bfloat16 copy); the slices
    give the whole product."""
    monkeypatch.setattr(qm, "bf16_gemm_enabled", lambda: True)
    monkeypatch.setattr(qm, "bf16_gemm_min_rows", lambda: qm.BF16_GEMM_MIN_ROWS)
    monkeypatch.setattr(
        qm, "BF16_GEMM_SLICE", 64 * 7
    )  # 7 rows of 64 at a time: 6 slices and a tail of 3
    gen = torch.Generator().manual_seed(4)
    qw = quantize_int4(torch.randn(45, 64, generator=gen))
    x, bias = torch.randn(60, 64, generator=gen), torch.randn(45, generator=gen)
    sizes = []
    dequant = qm.dequantize
    monkeypatch.setattr(
        qm, "dequantize", lambda part, dtype: sizes.append(part.shape[0]) or dequant(part, dtype)
    )
    y = quant_matmul(x, qw, bias)
    assert sizes == [7] * 6 + [3]
    scale = (x.abs() @ dequantize_ref(qw).abs().t()).amax()
    torch.testing.assert_close(
        y, _bf16_reference(x, qw, bias), rtol=2**-7, atol=float(scale) * 2**-12
    )


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "int8-g32", "int4"])
def test_native_bf16_dequantization_rounds_to_nearest_even(fmt: str) -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(33, 160, generator=gen) * torch.logspace(-3, 3, 160)
    qw = {
        "int8": lambda: quantize_int8(w),
        "int8-g32": lambda: quantize_int8(w, 32),
        "int4": lambda: quantize_int4(w),
    }[fmt]()
    out = dequantize(qw, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, dequantize_ref(qw).bfloat16())


def test_bf16_gemm_setting(monkeypatch) -> None:
    """PLAIT_BF16_GEMM: "1" on, anything else (unset, "auto", "0") off: the bfloat16 GEMM costs
    accuracy, so it is never on by default, whatever the CPU."""
    try:
        for value, expected in (("0", False), ("no", False), ("1", True), ("true", True)):
            monkeypatch.setenv(qm.BF16_GEMM_ENV, value)
            environment.reload()
            qm.bf16_gemm_enabled.cache_clear()
            assert qm.bf16_gemm_enabled() is expected
        for unset in (None, "auto"):
            if unset is None:
                monkeypatch.delenv(qm.BF16_GEMM_ENV)
            else:
                monkeypatch.setenv(qm.BF16_GEMM_ENV, unset)
            environment.reload()
            qm.bf16_gemm_enabled.cache_clear()
            assert qm.bf16_gemm_enabled() is False
    finally:
        monkeypatch.undo()
        environment.reload()
        qm.bf16_gemm_enabled.cache_clear()


@pytest.mark.parametrize("levels,fraction", [(1, 2), (2, 256)])
def test_q8_activation_rounding_per_block(levels: int, fraction: int) -> None:
    """Half a step with one level; a 256th of one with two (up to float32 rounding at x's scale:
    unseeded, 1.7% of draws missed a bound without that term, by under 5e-8 of |x|)."""
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(7)) * torch.logspace(-2, 2, 128)
    back = q8_activations(x, levels)
    step = x.reshape(3, 4, 32).abs().amax(-1, keepdim=True) / 127
    error = (back - x).reshape(3, 4, 32).abs()
    assert torch.all(
        error <= step / fraction * (1 + 1e-4) + x.reshape(3, 4, 32).abs() * 2**-22 + 1e-7
    )
    assert torch.all(error.amax(-1, keepdim=True) > step / fraction / 8)  # and not much less
    assert torch.equal(q8_activations(torch.zeros(2, 32), levels), torch.zeros(2, 32))


@needs_native
def test_leading_dimensions_and_empty_batches() -> None:
    qw = quantize_int4(torch.randn(8, 64))
    x = torch.randn(2, 3, 64)
    assert quant_matmul(x, qw).shape == (2, 3, 8)
    expected = quant_matmul_ref(x, qw, q8=qm.QuantMatmul(qw).rounds_to_int8(6))
    torch.testing.assert_close(quant_matmul(x, qw), expected, atol=1e-4, rtol=1e-4)
    assert quant_matmul(torch.randn(0, 64), qw).shape == (0, 8)


def test_gguf_blocks_equal_the_dequantized_tensor(gguf_path) -> None:
    from plait.runtime.model_loader.gguf_file import GgufFile
    from plait.runtime.model_loader.gguf_loader import _dequantize, _quantized_blocks

    by_type = {}
    for t in GgufFile(gguf_path).tensors:
        if len(t.dims) == 2 and t.tensor_type.name in ("Q4_1", "Q8_0"):
            by_type.setdefault(t.tensor_type.name, t)
    assert set(by_type) == {"Q4_1", "Q8_0"}
    for t in by_type.values():
        qw = _quantized_blocks(t)
        expected = torch.from_numpy(np.array(_dequantize(t), dtype=np.float32))
        torch.testing.assert_close(dequantize_ref(qw), expected, atol=1e-6, rtol=1e-6)


def test_quant_linear_follows_its_buffers_when_moved():
    from plait.runtime.models.quantized import QuantLinear

    layer = QuantLinear(quantize_int4(torch.randn(8, 64)), torch.randn(8))
    old = layer.qweight
    layer._apply(lambda t: t.clone())  # what `.to(device)` does: new buffers
    assert (
        layer.qweight is not old
        and layer.qw.qweight is layer.qweight
        and layer.qw.scales is layer.scales
    )
    x = torch.randn(3, 64)
    expected = quant_matmul_ref(
        x, layer.qw, layer.bias, q8=qm.QuantMatmul(layer.qw).rounds_to_int8(3)
    )
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    layer.to(
        torch.float32
    )  # a model-wide dtype cast leaves the kernels' float16 scales as they are
    assert layer.scales.dtype == layer.mins.dtype == layer.qw.scales.dtype == torch.float16
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("m", [1, 3, 4, 5, 47, 48])
@pytest.mark.parametrize("k", [64, 40, 13])  # whole vector runs, a tail of single vectors, scalar
def test_dense_matmul_matches_linear(m: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m)
    w, bias = torch.randn(70, k, generator=gen), torch.randn(70, generator=gen)
    x = torch.randn(m, k, generator=gen)
    expected = torch.nn.functional.linear(x, w, bias)
    torch.testing.assert_close(qm.dense_matmul(x, w, bias), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        qm.dense_matmul(x.reshape(1, m, k), w),
        expected.reshape(1, m, 70) - bias,
        atol=1e-4,
        rtol=1e-4,
    )


@needs_native
def test_dense_matmul_keeps_a_large_matrix_on_the_native_kernel_at_any_row_count(
    monkeypatch,
) -> None:
    """An LM head-sized weight takes the native kernel at prefill row counts too (it beat torch's
    GEMM)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn((qm.DEQUANT_GEMM_MAX_ELEMENTS // 256) + 1, 256, generator=gen)
    x = torch.randn(qm.DEQUANT_GEMM_MIN_ROWS + 3, 256, generator=gen)
    kernels, calls = qm._kernels(), []
    monkeypatch.setattr(
        qm, "_kernels", lambda: (lambda *a: calls.append(a) or kernels[0](*a), *kernels[1:])
    )
    torch.testing.assert_close(
        qm.dense_matmul(x, w), torch.nn.functional.linear(x, w), atol=1e-3, rtol=1e-4
    )
    assert len(calls) == 1
    qm.dense_matmul(x, w[:64])  # a small matrix at that many rows: torch's GEMM
    assert len(calls) == 1


def test_a_quant_linear_chooses_its_paths_once(monkeypatch) -> None:
    from plait.kernels import native
    from plait.runtime.models.quantized import QuantLinear

    layer = QuantLinear(quantize_int8(torch.randn(8, 64)), None)
    chosen = layer.matmul.path(1)
    x = torch.randn(1, 64)
    expected = layer(x)
    monkeypatch.setattr(native, "DISABLED", True)
    assert layer.matmul.path(1) == chosen  # settled when the buffers were placed
    assert torch.equal(layer(x), expected)
    assert QuantLinear(quantize_int8(torch.randn(8, 64)), None).matmul.path(1) == "reference"
    layer.to(torch.device("cpu"))  # placing the buffers again chooses again
    assert layer.matmul.path(1) == "reference"
    torch.testing.assert_close(layer(x), expected, atol=1e-2, rtol=1e-2)
