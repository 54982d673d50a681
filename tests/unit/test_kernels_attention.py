"""Triton paged attention (KV store, decode with GQA and split-K, ragged extend over a cached
prefix) against the torch reference `kernels.attention.paged_attention`, on batches laid out as
the model runner lays them out. CPU tensors run in Triton's interpreter (small sizes); `gpu` tests
use CUDA.
"""

from __future__ import annotations

import pytest
import torch

from plait.kernels.attention import paged_attention_ref, write_kv
from tests.unit.attention_cases import Case, make_batch, tolerance

pytest.importorskip("triton")

from plait.kernels.attention_triton import (  # noqa: E402
    choose_num_kv_splits,
    decode_attention_triton,
    paged_attention_triton,
    store_kv_triton,
    tables_from_pages,
    triton_metadata_from,
)


def check(case: Case, device: str = "cpu", num_kv_splits: int | None = None, seed: int = 0) -> None:
    q, k, v, k_cache, v_cache, meta, _ = make_batch(case, device, seed)
    scale = case.head_dim**-0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = paged_attention_ref(q, k, v, ref_k, ref_v, meta, scale, case.sliding_window)
    tables = triton_metadata_from(meta, case.page_size, case.num_kv_heads, num_kv_splits)
    actual = paged_attention_triton(
        q, k, v, k_cache, v_cache, meta, scale, case.sliding_window, tables
    )
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(actual, expected, **tolerance(case.dtype))


# CPU, Triton interpreter -----------------------------------------------------------------------

DECODE_CASES = [
    # contexts around page boundaries (15, 16, 17, 32, 33), GQA ratios 1, 2, 3 and 8
    Case([], [1, 16, 17], num_heads=4, num_kv_heads=4),
    Case([], [15, 33, 70], num_heads=4, num_kv_heads=2, page_size=1),
    Case([], [32, 5], num_heads=6, num_kv_heads=2, head_dim=128),
    Case([], [100], num_heads=8, num_kv_heads=1, page_size=16),
]


@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(case, splits):
    check(case, num_kv_splits=splits)


EXTEND_CASES = [
    Case([(0, 17)], [], page_size=16),  # fresh prefill crossing a page
    Case([(16, 5), (3, 30)], [], page_size=16, num_heads=6, num_kv_heads=2),  # cached prefixes
    Case([(7, 9), (0, 1)], [], page_size=1, num_heads=4, num_kv_heads=4, head_dim=128),
    Case([(0, 70)], [], page_size=16, num_heads=2, num_kv_heads=1),  # two query blocks
]


@pytest.mark.parametrize("case", EXTEND_CASES)
def test_extend_matches_reference(case):
    check(case)


def test_mixed_batch_matches_reference():
    check(Case([(16, 3), (0, 12)], [9, 48, 1], num_heads=4, num_kv_heads=2), num_kv_splits=2)


def test_sliding_window_matches_reference():
    case = Case([(20, 12)], [40, 7], num_heads=4, num_kv_heads=2, page_size=16, sliding_window=9)
    check(case, num_kv_splits=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_reference(dtype):
    check(Case([(5, 11)], [33], num_heads=4, num_kv_heads=2, dtype=dtype), num_kv_splits=2)


def test_store_kv_matches_write_kv():
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(5, 4, 2, 64)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(6, 4 * 64 + 2 * 2 * 64, generator=gen)  # a fused projection: strided views
    k = qkv[:, 256:384].view(6, 2, 64)
    v = qkv[:, 384:].view(6, 2, 64)
    slots = torch.tensor([19, 0, 3, 4, 7, 12])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv(k, v, ref_k, ref_v, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_adapter_page_tables():
    case = Case([(16, 4)], [17, 3], page_size=16)
    *_, meta, _ = make_batch(case, seed=3)
    tables = triton_metadata_from(meta, 16, 2, num_kv_splits=4)
    for i, n in enumerate([17, 3]):
        pages = tables.decode_page_table[i]
        pos = torch.arange(n)
        slots = pages.long()[pos // 16] * 16 + pos % 16
        assert torch.equal(slots, meta.decode_kv_slots[i, :n])
    assert tables.decode_kv_lens.tolist() == [17, 3] and tables.num_kv_splits == 4
    assert tables.extend_kv_lens.tolist() == [20] and not tables.extends_have_no_prefix


def test_tables_from_pages_match_the_adapter():
    case = Case([(16, 3), (0, 12)], [9, 48, 1], num_heads=4, num_kv_heads=2)
    q, k, v, k_cache, v_cache, meta, pages = make_batch(case, seed=4)
    n_ext = len(case.extends)
    lens = dict(extend_q_lens=[n for _, n in case.extends], extend_kv_lens=meta.extend_kv_lens)
    built = tables_from_pages(
        16,
        2,
        "cpu",
        pages[:n_ext],
        **lens,
        decode_pages=pages[n_ext:],
        decode_kv_lens=case.decodes,
        num_kv_splits=2,
    )
    adapted = triton_metadata_from(meta, 16, 2, num_kv_splits=2)
    for name in (
        "extend_page_table",
        "extend_q_starts",
        "extend_q_lens",
        "extend_kv_lens",
        "extend_cu_seqlens",
        "decode_page_table",
        "decode_kv_lens",
    ):
        assert torch.equal(getattr(built, name), getattr(adapted, name)), name
    assert built.max_extend_q_len == adapted.max_extend_q_len == 12
    wide = tables_from_pages(
        16,
        2,
        "cpu",
        pages[:n_ext],
        **lens,
        decode_pages=pages[n_ext:],
        decode_kv_lens=case.decodes,
        num_kv_splits=2,
        decode_width=7,
    )
    assert wide.decode_page_table.shape == (3, 7)
    expected = paged_attention_ref(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    actual = paged_attention_triton(q, k, v, k_cache, v_cache, meta, 0.125, None, wide)
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


def test_decode_padded_row_is_finite():
    """A CUDA-graph bucket pads the batch with kv_len 0 rows: they must not produce NaN."""
    q = torch.randn(2, 4, 64)
    cache = torch.randn(2, 16, 2, 64)
    table = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    for splits in (1, 2):
        out = decode_attention_triton(q, cache, cache, table, lens, 0.125, num_kv_splits=splits)
        assert torch.isfinite(out).all()


def test_choose_num_kv_splits():
    cpu = torch.device("cpu")
    assert choose_num_kv_splits(64, 8, 100, cpu) == 1
    assert 1 < choose_num_kv_splits(1, 2, 32768, cpu) <= 64


# CUDA, full sizes --------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(32, 8, 64), (9, 3, 64), (32, 8, 128), (16, 16, 128)])
def test_gpu_decode_and_extend(page_size, heads, dtype=torch.bfloat16):
    num_heads, num_kv_heads, head_dim = heads
    shapes = dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    check(Case([], [1, 16, 17, 255, 256, 257, 4096, 8191], **shapes), "cuda")
    check(Case([], [32768, 1000], **shapes), "cuda")
    check(Case([(0, 1000), (512, 333), (17, 1), (4096, 64)], [77, 2049], **shapes), "cuda")


@pytest.mark.gpu
@gpu
def test_gpu_sliding_window_and_fixed_splits():
    for splits in (1, 7, 64):
        case = Case(
            [(300, 100)],
            [5000, 31],
            sliding_window=1024,
            num_heads=32,
            num_kv_heads=8,
            dtype=torch.bfloat16,
        )
        check(case, "cuda", num_kv_splits=splits)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes(dtype):
    check(
        Case([(100, 50), (0, 300)], [300, 4, 4097], num_heads=8, num_kv_heads=2, dtype=dtype),
        "cuda",
    )
