"""KV cache storage formats (`kernels/kv_cache.py`): the int8 round trip is bounded by half a
quantization step, the native store writes what the torch store writes, and attention over
bfloat16 / int8 caches (native rows and the torch reference) matches its float32 counterpart."""

from __future__ import annotations

import pytest
import torch

from plait.kernels import attention_cpu, native
from plait.kernels.attention import paged_attention, paged_attention_ref
from plait.kernels.kv_cache import dequantize_int8, quantize_int8, store_kv
from tests.unit.attention_cases import Case, make_batch, tolerance

DTYPES = [torch.bfloat16, torch.int8]


def as_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype):
    """The float32 caches of a test batch converted to `dtype`, with scales for int8."""
    if dtype != torch.int8:
        return k_cache.to(dtype), v_cache.to(dtype), None
    kq, ks = quantize_int8(k_cache)
    vq, vs = quantize_int8(v_cache)
    return kq, vq, (ks, vs)


def test_int8_round_trip_error_is_half_a_step() -> None:
    x = torch.randn(500, 3, 64) * torch.logspace(-3, 2, 500)[:, None, None]
    x[7] = 0.0  # an all-zero head keeps a finite scale
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (500, 3)
    back = dequantize_int8(q, scale, torch.float32)
    err = (back - x).abs()
    assert torch.all(err <= scale[..., None] * 0.5 + 1e-6 * x.abs())
    assert torch.all(back[7] == 0)
    # relative to each head's largest value the error is at most 1/254
    assert (err.amax(-1) / x.abs().amax(-1).clamp(min=1e-30)).max() <= 1 / 254 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES], ids=str)
def test_native_store_writes_what_torch_writes(monkeypatch, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, 3 * 4 * 16, generator=gen)  # k and v are strided views into a fused row
    k = qkv[:, 64:128].view(9, 4, 16)
    v = qkv[:, 128:].view(9, 4, 16)
    slots = torch.tensor([5, 0, 17, 3, 30, 31, 8, 9, 22])

    def stored(disabled: bool):
        monkeypatch.setattr(native, "DISABLED", disabled)
        kc = torch.zeros(8, 4, 4, 16, dtype=dtype)
        vc = torch.zeros_like(kc)
        scales = (torch.ones(8, 4, 4), torch.ones(8, 4, 4)) if dtype == torch.int8 else None
        store_kv(k, v, kc, vc, slots, scales)
        return kc, vc, scales

    if native.load("cpu_kernels") is None:
        pytest.skip("native CPU kernels did not build")
    reference = stored(True)
    ours = stored(False)
    for a, b in zip(ours[:2], reference[:2]):
        assert (a.float() - b.float()).abs().max() <= (1 if dtype == torch.int8 else 0)
    if dtype == torch.int8:
        torch.testing.assert_close(ours[2], reference[2])
        back = dequantize_int8(
            ours[0].view(-1, 4, 16)[slots], ours[2][0].view(-1, 4)[slots], torch.float32
        )
        torch.testing.assert_close(back, k, atol=0.02, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES], ids=str)
@pytest.mark.parametrize("bad", [32, -1])
def test_a_slot_outside_the_pool_raises_and_stores_nothing(monkeypatch, dtype, bad) -> None:
    k, v = torch.randn(3, 4, 16), torch.randn(3, 4, 16)
    slots = torch.tensor([5, bad, 7])
    for disabled in (False, True):  # the native store checks first; torch's index_copy_ raises too
        monkeypatch.setattr(native, "DISABLED", disabled)
        kc, vc = (
            torch.zeros(8, 4, 4, 16, dtype=dtype),
            torch.zeros(8, 4, 4, 16, dtype=dtype),
        )  # 32 slots
        scales = (torch.ones(8, 4, 4), torch.ones(8, 4, 4)) if dtype == torch.int8 else None
        with (
            pytest.raises(IndexError)
            if not disabled
            else pytest.raises((IndexError, RuntimeError)) as err
        ):
            store_kv(k, v, kc, vc, slots, scales)
        if not disabled:
            assert f"slots[1] = {bad}" in str(err.value) and "32 slots" in str(err.value)
            assert not kc.any() and not vc.any()


CASES = [
    Case(extends=[], decodes=[5, 37, 130, 1, 64], num_heads=9, num_kv_heads=3, page_size=1),
    Case(extends=[(20, 3), (0, 40), (7, 16), (50, 17)], decodes=[9, 200], page_size=4),
    Case(extends=[(30, 5)], decodes=[3, 100, 45], sliding_window=8, page_size=16),
    Case(extends=[], decodes=[1500], num_heads=9, num_kv_heads=3, page_size=1),  # split-K
    Case(
        extends=[(3, 2)], decodes=[11, 70], num_heads=6, num_kv_heads=2, head_dim=20, page_size=1
    ),  # a tail
    Case(
        extends=[(20, 2)], decodes=[47, 129], num_heads=8, num_kv_heads=2, head_dim=128, page_size=4
    ),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"e{c.extends}-d{c.decodes}-w{c.sliding_window}"
)
def test_attention_over_compact_caches(case: Case, dtype) -> None:
    q, k, v, k_cache, v_cache, meta, _ = make_batch(case, seed=5)
    scale = case.head_dim**-0.5
    exact = paged_attention_ref(
        q, k, v, k_cache.clone(), v_cache.clone(), meta, scale, case.sliding_window
    )
    kc, vc, scales = as_cache(k_cache, v_cache, dtype)
    ref = paged_attention_ref(
        q, k, v, kc.clone(), vc.clone(), meta, scale, case.sliding_window, scales
    )
    # the stored values differ from float32 by rounding; attention stays close
    torch.testing.assert_close(ref, exact, atol=0.03, rtol=0)
    if not attention_cpu.native_attention_available():
        pytest.skip("native CPU kernels did not build")
    meta.cpu = None
    ours = paged_attention(q, k, v, kc, vc, meta, scale, case.sliding_window, scales)
    assert meta.cpu is not None  # the native rows ran
    torch.testing.assert_close(ours, ref, **tolerance(torch.float32))
