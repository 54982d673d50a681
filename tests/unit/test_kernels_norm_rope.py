"""RMSNorm, fused residual-add + RMSNorm and rotary embedding: the torch references against the
model's own layers, the Triton kernels (interpreted on CPU; compiled on CUDA) against the
references.
"""

from __future__ import annotations

import pytest
import torch

from plait.kernels.layer_ops import LayerOps, apply_rotary, rotary_tables
from plait.kernels.norm_rope import fused_add_rms_norm_ref, rms_norm_ref, rotary_ref
from plait.runtime.models.args import ModelArgs
from plait.runtime.models.layers import RMSNorm, rope_inv_freq

pytest.importorskip("triton")

from plait.kernels.norm_rope import fused_add_rms_norm_triton, rms_norm_triton, rotary_triton  # noqa: E402

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def cos_sin(
    num_tokens: int, head_dim: int, dtype: torch.dtype, device: str = "cpu", theta: float = 10000.0
):
    args = ModelArgs(
        vocab_size=10,
        hidden_size=head_dim,
        intermediate_size=1,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=head_dim,
        rope_theta=theta,
    )
    positions = torch.randint(
        0, 8192, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens)
    )
    cos, sin = rotary_tables(positions.to(device), rope_inv_freq(args).to(device))
    return cos.to(dtype), sin.to(dtype)


def test_references_are_the_model_layers():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    res = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    norm = RMSNorm(96, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(generator=gen)
        assert torch.equal(rms_norm_ref(x, norm.weight, 1e-5), norm(x, ops=LayerOps()))
        out, summed = fused_add_rms_norm_ref(x, res, norm.weight, 1e-5)
        assert torch.equal(summed, x + res) and torch.equal(out, norm(x + res, ops=LayerOps()))
    q = torch.randn(5, 3, 64, generator=gen).to(torch.bfloat16)
    cos, sin = cos_sin(5, 64, torch.bfloat16)
    assert torch.equal(rotary_ref(q, cos, sin), apply_rotary(q, cos, sin))


# CPU, Triton interpreter -----------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [64, 96, 576, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(3, hidden, generator=gen) * 3).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    torch.testing.assert_close(
        rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **TOL[dtype]
    )


@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_add_rms_norm_matches_reference(hidden, dtype):
    gen = torch.Generator().manual_seed(hidden + 1)
    x = torch.randn(4, hidden, generator=gen).to(dtype)
    residual = torch.randn(4, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    expected, expected_sum = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    out, new_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    assert new_residual is residual
    if dtype == torch.bfloat16:  # NOTE: the interpreter truncates float32 -> bf16 (GPUs round)
        torch.testing.assert_close(residual, expected_sum, atol=0, rtol=2**-7)
    else:
        assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize(
    "heads,head_dim", [((4, 2), 64), ((9, 3), 64), ((2, 1), 128), ((1, 1), 80)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_reference_on_fused_qkv_views(heads, head_dim, dtype):
    num_heads, num_kv_heads = heads
    tokens = 5
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=torch.Generator().manual_seed(7)).to(
        dtype
    )
    q = qkv[:, :q_size].view(tokens, num_heads, head_dim)  # strided views, as the model makes them
    k = qkv[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    cos, sin = cos_sin(tokens, head_dim, dtype)
    expected_q, expected_k = rotary_ref(q, cos, sin), rotary_ref(k, cos, sin)
    v_before = qkv[:, q_size + kv_size :].clone()
    rotary_triton(q, cos, sin)
    rotary_triton(k, cos, sin)
    torch.testing.assert_close(q, expected_q, **TOL[dtype])
    torch.testing.assert_close(k, expected_k, **TOL[dtype])
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)


# CUDA, full sizes --------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 77, 8192])
@pytest.mark.parametrize("hidden", [576, 2048, 4096, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_norms(tokens, hidden, dtype):
    x = torch.randn(tokens, hidden, device="cuda").to(dtype)
    residual = torch.randn(tokens, hidden, device="cuda").to(dtype)
    weight = torch.randn(hidden, device="cuda").to(dtype)
    torch.testing.assert_close(
        rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **TOL[dtype]
    )
    expected, expected_sum = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    out, _ = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 300, 8192])
@pytest.mark.parametrize(
    "heads,head_dim", [((32, 8), 64), ((9, 3), 64), ((32, 8), 128), ((64, 8), 128)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rotary(tokens, heads, head_dim, dtype):
    num_heads, num_kv_heads = heads
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, device="cuda").to(dtype)
    q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    cos, sin = cos_sin(tokens, head_dim, dtype, "cuda", theta=500000.0)
    expected_q, expected_k = rotary_ref(q, cos, sin), rotary_ref(k, cos, sin)
    rotary_triton(q, cos, sin)
    rotary_triton(k, cos, sin)
    torch.testing.assert_close(q, expected_q, **TOL[dtype])
    torch.testing.assert_close(k, expected_k, **TOL[dtype])
