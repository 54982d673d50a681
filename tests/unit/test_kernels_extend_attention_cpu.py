"""The native prefill attention (`csrc/cpu_extend_attention.cpp`, AVX2 and AVX-512 builds) against
torch's scaled_dot_product_attention with an explicit mask: causal, over a cached prefix, sliding
windows, GQA and MHA, head sizes that are and are not multiples of 16, query counts off the
kernel's blocks; and that other shapes and disabled kernels fall back to the torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.kernels import native
from plait.kernels.attention_extend import (
    extend_attention,
    extend_attention_ref,
    native_extend_attention,
)
from plait.kernels.quant_matmul import native_isa


def served(head_dim: int) -> bool:
    """Whether this build's kernel takes the shape: AVX2 or AVX-512 builds, head_dim % 8 == 0."""
    return native_isa() in ("avx2", "avx512-vnni") and head_dim % 8 == 0


def sdpa_reference(q, k, v, prefix_len, scale, window):
    q_pos = torch.arange(prefix_len, prefix_len + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    "q_len,prefix_len,heads,kv_heads,head_dim,window",
    [
        (512, 0, 9, 3, 64, None),  # SmolLM2's heads, whole blocks
        (37, 0, 4, 4, 32, None),  # MHA, a partial block of queries and keys
        (70, 50, 8, 2, 128, None),  # over a cached prefix, two passes of 64 columns
        (100, 20, 9, 3, 64, 16),  # a window shorter than a key block
        (200, 77, 9, 3, 64, 50),  # a window across blocks, keys before it skipped
        (33, 0, 6, 1, 16, 7),  # one KV head for six query heads
        (1, 40, 9, 3, 64, None),  # a single token
        (45, 3, 10, 2, 80, None),  # 80 columns: 64 and a rest of 16
        (20, 5, 4, 2, 40, None),  # 40 columns: 8-wide on AVX-512 builds too
        (20, 5, 4, 2, 20, None),  # 20 columns: not served natively
    ],
)
def test_native_prefill_attention_matches_sdpa(
    q_len, prefix_len, heads, kv_heads, head_dim, window
):
    gen = torch.Generator().manual_seed(q_len * 7 + prefix_len)
    q = torch.randn(q_len, heads, head_dim, generator=gen)
    k = torch.randn(prefix_len + q_len, kv_heads, head_dim, generator=gen)
    v = torch.randn(prefix_len + q_len, kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    expected = sdpa_reference(q, k, v, prefix_len, scale, window)
    out = native_extend_attention(q, k, v, prefix_len, scale, window)
    assert (out is not None) == served(head_dim)
    if out is not None:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(
        extend_attention(q, k, v, prefix_len, scale, window), expected, atol=2e-5, rtol=1e-4
    )


def test_disabled_native_kernels_leave_prefill_attention_to_torch(monkeypatch):
    monkeypatch.setattr(native, "DISABLED", True)
    q, k, v = torch.randn(8, 2, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    assert native_extend_attention(q, k, v, 0, 0.25, None) is None
    torch.testing.assert_close(
        extend_attention(q, k, v, 0, 0.25), sdpa_reference(q, k, v, 0, 0.25, None)
    )
    torch.testing.assert_close(
        extend_attention_ref(q, k, v, 0, 0.25), sdpa_reference(q, k, v, 0, 0.25, None)
    )


@pytest.mark.parametrize(
    "q_len,prefix_len,heads,kv_heads,head_dim",
    [
        (300, 0, 9, 3, 64),
        (64, 64, 9, 3, 64),
        (100, 37, 4, 4, 32),
        (60, 20, 6, 1, 16),
        (24, 900, 9, 3, 64),
    ],
)
def test_bf16_prefill_attention_is_within_bfloat16_rounding(
    q_len, prefix_len, heads, kv_heads, head_dim
):
    """torch's flash attention in bfloat16; a cached prefix attended apart and merged by the
    log-sum-exps gives the causal attention over the whole."""
    from plait.kernels.attention_extend import bf16_extend_attention

    gen = torch.Generator().manual_seed(q_len + prefix_len)
    q = torch.randn(q_len, heads, head_dim, generator=gen)
    k = torch.randn(prefix_len + q_len, kv_heads, head_dim, generator=gen)
    v = torch.randn(prefix_len + q_len, kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    expected = sdpa_reference(q, k, v, prefix_len, scale, None)
    out = bf16_extend_attention(q, k, v, prefix_len, scale)
    if out is None:
        pytest.skip("this torch has no CPU flash attention operator")
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert (out - expected).norm() / expected.norm() < 1e-2  # bfloat16 operands: ~3e-3 seen
    assert (out - expected).abs().max() < 0.05


def test_bf16_prefill_attention_takes_chunks_with_enough_work(monkeypatch):
    """With `bf16` (quantized models on AMX CPUs, see ModelRunner.bf16_extends): BF16_EXTEND_MIN_Q
    new tokens or more, once new tokens x keys reach BF16_EXTEND_MIN_WORK; no sliding window."""
    from plait.kernels import attention_extend as attention

    calls = []
    real = attention.bf16_extend_attention
    monkeypatch.setattr(
        attention, "bf16_extend_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    assert (attention.BF16_EXTEND_MIN_Q, attention.BF16_EXTEND_MIN_WORK) == (16, 20_000)
    for q_len, prefix_len, bf16, window in [
        (512, 0, True, None),
        (48, 0, True, None),
        (16, 1300, True, None),
        (15, 2000, True, None),
        (96, 100, True, None),
        (160, 0, True, None),
        (512, 0, False, None),
        (512, 0, True, 8),
    ]:
        q, k, v = (
            torch.randn(q_len, 4, 16),
            torch.randn(prefix_len + q_len, 2, 16),
            torch.randn(prefix_len + q_len, 2, 16),
        )
        out = extend_attention(q, k, v, prefix_len, 0.25, window, bf16)
        torch.testing.assert_close(
            out, sdpa_reference(q, k, v, prefix_len, 0.25, window), atol=0.05, rtol=0.05
        )
    assert calls == [512, 16, 160]
