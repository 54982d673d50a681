"""GGUF's block types in the quantized kernels (Q4_0, Q4_1, Q8_0, Q5_0 and the k-quants Q4_K, Q5_K,
Q6_K): the k-quants and Q5_0 load as the file's weights bit for bit (Q5_0 and Q5_K as packed
five-bit values), and for every type the native kernel equals the torch reference
(`quant_matmul_ref` with x rounded as the kernel rounds it) at decode and prefill row counts, on
odd numbers of rows, and a row's result is the same to the bit alone and inside batches of 2 to 32
rows.

Tolerance: against the reference that rounds x the same way (`q8_activations`, two int8 levels
per 32 values), the kernel differs only by float32 summation order: 2e-4 of the result plus 1e-5
of the sum of the terms' magnitudes. Against float
activations the two-level rounding adds at most 1/256 of an int8 step of x per block, far below
the weights' own quantization error (checked below on each type)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plait.kernels import quant_matmul as qm
from plait.kernels.quant_matmul import dequantize, quant_matmul
from plait.kernels.quant_weights import (
    FORMAT_CODE,
    QuantizedWeight,
    dequantize_ref,
    pack_int5,
    quant_matmul_ref,
    unpack_int5,
)
from plait.runtime.model_loader.gguf_blocks import quantized_blocks

KQUANTS = ["Q5_0", "Q4_K", "Q5_K", "Q6_K"]
BLOCK_TYPES = ["Q4_0", "Q4_1", "Q8_0", *KQUANTS]
# rows not a multiple of a task's 16 or the eight rows reduced at once; K a multiple of 256 (a
# k-quant superblock): 1, 2, 3 and 9 superblocks (odd counts of eight-block runs and of pairs)
SHAPES = [(37, 256), (21, 512), (9, 768), (45, 2304)]

needs_native = pytest.mark.skipif(
    not qm.native_quant_available(), reason="native CPU kernels did not build"
)


def gguf_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """[n, k] in `kind`'s blocks: quantized by gguf where it can, else random bytes with bit 6
    clear (every float16 scale inside them is then finite)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(seed)
    try:
        return gguf.quants.quantize(rng.normal(0, 0.1, (n, k)).astype(np.float32), qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, (n, k // block * size), dtype=np.uint8) & np.uint8(0xBF)


@pytest.mark.parametrize("kind", KQUANTS)
def test_blocks_load_as_gguf_dequantizes_them(kind: str) -> None:
    import gguf

    for n, k in SHAPES:
        raw = gguf_blocks(kind, n, k, seed=n)
        expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k)
        qw = quantized_blocks(kind, raw, n, k)
        ours = dequantize_ref(qw).numpy()
        assert np.array_equal(ours.view(np.uint32), expected.astype(np.float32).view(np.uint32))
        # packed 4- and 5-bit values, int8 for 6 bits; float32 scales where float16 would round
        assert qw.format == {"Q4_K": "int4", "Q5_0": "int5", "Q5_K": "int5"}.get(kind, "int8")
        assert qw.scales.dtype == (torch.float16 if kind == "Q5_0" else torch.float32)
        assert qw.group == (16 if kind == "Q6_K" else 32)
        if qw.format == "int5":  # 5 bits a weight, as the file holds them, with its scales
            assert qw.qweight.shape == (n, k // 2 + k // 8)


def test_q5_0_rows_that_64_does_not_divide_load_as_int8() -> None:
    import gguf

    raw = gguf_blocks("Q5_0", 5, 96, seed=1)
    qw = quantized_blocks("Q5_0", raw, 5, 96)
    assert qw.format == "int8"
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0).reshape(5, 96)
    assert np.array_equal(dequantize_ref(qw).numpy(), expected)
    with pytest.raises(ValueError, match="int5 needs groups of 32 and K a multiple of 64"):
        QuantizedWeight("int5", torch.zeros(5, 60, dtype=torch.uint8), qw.scales, None, 32)


def test_int5_packs_and_unpacks_every_value() -> None:
    q = torch.randint(0, 32, (7, 320), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int5(pack_int5(q)), q.to(torch.uint8))


@needs_native
@pytest.mark.parametrize("m", [1, 3, 17, qm.DEQUANT_GEMM_MIN_ROWS + 1])
@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_native_kernel_matches_reference(kind: str, m: int, monkeypatch) -> None:
    monkeypatch.setattr(qm, "bf16_gemm_enabled", lambda: False)  # AMX machines: the bfloat16 tests
    for n, k in SHAPES:
        gen = torch.Generator().manual_seed(m * 1000 + n)
        qw = quantized_blocks(kind, gguf_blocks(kind, n, k, seed=n), n, k)
        x = torch.randn(m, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        q8 = qm.QuantMatmul(qw).rounds_to_int8(m)
        assert q8 == (m <= qm.q8_max_rows())  # every shape here takes int8 activations
        expected = quant_matmul_ref(x, qw, bias, q8=q8)
        w = dequantize_ref(qw)
        # float32 sums in another order: relative to the sum of the terms' magnitudes (random
        # k-quant bytes hold large minimums that cancel)
        magnitude = x.abs() @ w.abs().t() + bias.abs()
        assert (
            (quant_matmul(x, qw, bias) - expected).abs() <= 2e-4 * expected.abs() + 1e-5 * magnitude
        ).all()
        torch.testing.assert_close(dequantize(qw), w, atol=0, rtol=0)
        # x's two-level int8 rounding adds a small fraction of the weights' own error
        weight_error = (quant_matmul_ref(x, qw, bias) - (x @ w.t() + bias)).abs().mean()
        exact = quant_matmul_ref(x, qw, bias)
        assert (expected - exact).abs().mean() < 0.05 * exact.abs().mean() + weight_error


@needs_native
@pytest.mark.parametrize("n,k", [(45, 768), (21, 512)])
@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind: str, n: int, k: int) -> None:
    qw = quantized_blocks(kind, gguf_blocks(kind, n, k, seed=3), n, k)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([quant_matmul(x[i : i + 1], qw) for i in range(32)])
    for m in (2, 3, 4, 7, 8, 9, 16, 17, 31, 32):
        assert torch.equal(quant_matmul(x[:m], qw), alone[:m]), f"{m} rows"
    # and wherever the row sits in its batch
    assert torch.equal(quant_matmul(x.flip(0), qw), alone.flip(0))


def test_scales_and_mins_agree_in_dtype() -> None:
    qw = quantized_blocks("Q4_K", gguf_blocks("Q4_K", 4, 256, seed=0), 4, 256)
    with pytest.raises(ValueError, match="mins must be torch.float32"):
        QuantizedWeight("int4", qw.qweight, qw.scales, qw.mins.half(), 32)
    with pytest.raises(ValueError, match="int8 mins need groups of 16 or 32"):
        QuantizedWeight(
            "int8", torch.zeros(4, 256, dtype=torch.int8), torch.ones(4, 4), torch.ones(4, 8), 64
        )
    assert qw.code == FORMAT_CODE["int4-f32"]


@pytest.mark.parametrize(
    "kinds",
    [
        ("Q4_K", "Q4_K", "Q6_K"),
        ("Q5_0", "Q5_0", "Q8_0"),
        ("Q4_0", "Q5_K", "Q6_K"),
        ("Q5_K", "Q8_0"),
    ],
)
def test_mixed_block_types_stack_in_one_format_to_the_bit(kinds) -> None:
    """A fused qkv whose pieces differ in type (Q4_K_M's Q6_K v beside Q4_K q and k) stays in
    blocks: the pieces are widened to one int8 format that holds each exactly."""
    parts = [
        quantized_blocks(kind, gguf_blocks(kind, 8 + i, 512, seed=i), 8 + i, 512)
        for i, kind in enumerate(kinds)
    ]
    assert not QuantizedWeight.can_cat(parts)
    fused = QuantizedWeight.stack(parts)
    assert fused.format == "int8"
    assert torch.equal(dequantize_ref(fused), torch.cat([dequantize_ref(p) for p in parts]))
    if qm.native_quant_available():
        x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
        q8 = qm.QuantMatmul(fused).rounds_to_int8(5)
        expected = quant_matmul_ref(x, fused, q8=q8)
        magnitude = x.abs() @ dequantize_ref(fused).abs().t()
        err = (quant_matmul(x, fused) - expected).abs()
        assert (err <= 2e-4 * expected.abs() + 1e-5 * magnitude).all()
