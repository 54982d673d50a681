"""The native CPU row kernel (`kernels/attention_cpu.py`) against the torch reference: decode rows,
short extends over a cached prefix (speculative verification, jump-forward), long extends left to
SDPA, GQA and MHA, sliding windows, and the fallback when native kernels are disabled."""

from __future__ import annotations

import pytest
import torch

from plait import environment
from plait.kernels import attention_cpu, native
from plait.kernels.attention import paged_attention, paged_attention_ref
from tests.unit.attention_cases import Case, make_batch, tolerance

pytestmark = pytest.mark.skipif(
    not attention_cpu.native_attention_available(), reason="native CPU kernels did not build"
)

CASES = [
    Case(extends=[], decodes=[1]),
    Case(extends=[], decodes=[5, 37, 130, 1, 64], num_heads=9, num_kv_heads=3, page_size=1),
    Case(extends=[(20, 3), (0, 40), (7, 16), (50, 17)], decodes=[9, 200], page_size=4),
    Case(extends=[(33, 1)], decodes=[], num_heads=4, num_kv_heads=4, head_dim=32),
    Case(extends=[(30, 5)], decodes=[3, 100, 45], sliding_window=8, page_size=16),
    Case(
        extends=[], decodes=[3, 100, 45], sliding_window=16, page_size=4
    ),  # decodes only: tables as built
    Case(extends=[(0, 2)], decodes=[7], num_heads=8, num_kv_heads=1, head_dim=80, page_size=2),
    Case(
        extends=[(3, 2)], decodes=[11, 70], num_heads=6, num_kv_heads=2, head_dim=20, page_size=1
    ),  # a tail of 4
    Case(
        extends=[], decodes=[9, 40], num_heads=12, num_kv_heads=1, head_dim=16, page_size=4
    ),  # groups past 8
    # few rows over long contexts: each row's context is split across threads, then merged
    Case(extends=[], decodes=[1500], num_heads=9, num_kv_heads=3, page_size=1),
    Case(extends=[], decodes=[1200, 10], page_size=16),
    Case(extends=[(900, 2)], decodes=[], sliding_window=600, page_size=4),
    # head_dim 64 and 128 take the fixed-width kernel: blocks of 16 slots with tails, query heads
    # in register groups (4 a group at 64, 2 at 128: groups of 1, 3 and 5 leave partial ones)
    Case(extends=[], decodes=[16, 33, 100], num_heads=4, num_kv_heads=4, page_size=8),
    Case(extends=[], decodes=[50, 17, 2], num_heads=10, num_kv_heads=2, page_size=4),
    Case(
        extends=[(40, 3)],
        decodes=[47, 300],
        num_heads=12,
        num_kv_heads=4,
        head_dim=128,
        page_size=16,
    ),
    Case(extends=[], decodes=[700, 31], num_heads=8, num_kv_heads=8, head_dim=128, page_size=16),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"e{c.extends}-d{c.decodes}-w{c.sliding_window}"
)
def test_native_rows_match_reference(case: Case) -> None:
    q, k, v, k_cache, v_cache, meta, _ = make_batch(case, seed=3)
    scale = case.head_dim**-0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = paged_attention_ref(q, k, v, ref_k, ref_v, meta, scale, case.sliding_window)
    actual = attention_cpu.paged_attention_cpu(
        q, k, v, k_cache, v_cache, meta, scale, case.sliding_window
    )
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))
    torch.testing.assert_close(k_cache, ref_k)  # the new tokens' K/V were stored alike
    torch.testing.assert_close(v_cache, ref_v)


def test_scores_far_apart_in_the_last_slots_keep_the_larger() -> None:
    # Softmax subtracts each head's largest score; one missed in the slots past the last full vector
    # would leave two scores 1,000 apart both clamped at exp's limit, weighted alike.
    case = Case(extends=[], decodes=[23], num_heads=2, num_kv_heads=1, page_size=1)
    q, k, v, k_cache, v_cache, meta, _ = make_batch(case, seed=7)
    flat_k = k_cache.view(-1, case.head_dim)
    flat_k.zero_()
    table = meta.decode_kv_slots[0]
    for position, target in ((20, 2000.0), (21, 1000.0)):  # query head 0's scores; head 1's are 0
        flat_k[table[position]] = q[0, 0] * (target / (q[0, 0] @ q[0, 0]) / case.head_dim**-0.5)
    actual = attention_cpu.paged_attention_cpu(
        q, k, v, k_cache, v_cache, meta, case.head_dim**-0.5, None
    )
    torch.testing.assert_close(actual[0, 0], v_cache.view(-1, case.head_dim)[table[20]])


def test_rows_cover_decodes_and_short_extends_only() -> None:
    case = Case(extends=[(10, 2), (0, attention_cpu.MAX_ROW_EXTEND + 1)], decodes=[4, 6])
    _, _, _, _, _, meta, _ = make_batch(case)
    rows = attention_cpu.cpu_rows(meta, sliding_window=None)
    assert rows.row_extends == {0}
    # two rows for the short extend (causal: 11 and 12 positions), then one per decode
    assert rows.q_index.tolist() == [
        0,
        1,
        2 + attention_cpu.MAX_ROW_EXTEND + 1,
        3 + attention_cpu.MAX_ROW_EXTEND + 1,
    ]
    assert rows.kv_len.tolist() == [11, 12, 4, 6]


def test_dispatch_uses_native_on_cpu_float32_and_falls_back_when_disabled(monkeypatch) -> None:
    case = Case(extends=[(12, 2)], decodes=[20])
    q, k, v, k_cache, v_cache, meta, _ = make_batch(case, seed=1)
    calls = []
    real = attention_cpu.attention_rows
    monkeypatch.setattr(attention_cpu, "attention_rows", lambda *a: calls.append(1) or real(*a))
    first = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    assert calls == [1]
    monkeypatch.setattr(native, "DISABLED", True)
    meta.cpu = None
    second = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    assert calls == [1] and meta.cpu is None  # the reference ran
    torch.testing.assert_close(first, second, **tolerance(torch.float32))


def test_build_failure_is_reported_and_returns_none(monkeypatch, tmp_path, caplog) -> None:
    (tmp_path / "broken.cpp").write_text("this is not C++")
    monkeypatch.setattr(native, "CSRC", tmp_path)
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    environment.reload()
    native._load.cache_clear()
    try:
        assert native.cache_dir() == tmp_path / "cache" / "native"
        assert native.load("broken") is None
        assert "broken" in caplog.text and "failed" in caplog.text
    finally:
        monkeypatch.undo()
        environment.reload()
        native._load.cache_clear()
