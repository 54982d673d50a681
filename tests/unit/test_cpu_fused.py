"""The fused CPU elementwise kernels equal the model's torch math: RMSNorm, residual add +
RMSNorm (residual updated in place), rotary embedding on a fused qkv row, SiLU-and-multiply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.kernels import cpu_fused
from plait.kernels.layer_ops import LayerOps, NativeCpuOps, apply_rotary, rotary_tables
from plait.runtime.models.args import ModelArgs
from plait.runtime.models.layers import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not cpu_fused.usable(torch.zeros(1)), reason="native CPU kernels did not build"
)

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_and_add_rms_norm(rows):
    weight = torch.randn(96, generator=GEN)
    x, res = torch.randn(rows, 96, generator=GEN), torch.randn(rows, 96, generator=GEN)
    reference = LayerOps()
    torch.testing.assert_close(
        cpu_fused.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5, None)
    )
    expected_out, expected_res = reference.rms_norm(x, weight, 1e-5, res)
    out, new_res = cpu_fused.add_rms_norm(x, res.clone(), weight, 1e-5)
    torch.testing.assert_close(new_res, expected_res)
    torch.testing.assert_close(out, expected_out)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rope_in_place_on_fused_qkv(heads, kv_heads, head_dim):
    args = ModelArgs(
        vocab_size=10,
        hidden_size=heads * head_dim,
        intermediate_size=8,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=100000.0,
    )
    rotary = RotaryEmbedding(args)
    tokens = 11
    positions = torch.tensor([0, 1, 2, 7, 100, 513, 2047, 3, 4, 5, 4095])
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=GEN)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos, sin = rotary_tables(positions, rotary.inv_freq)
    expected_q = apply_rotary(q.reshape(tokens, heads, head_dim), cos, sin)
    expected_k = apply_rotary(k.reshape(tokens, kv_heads, head_dim), cos, sin)
    expected_v = v.clone()
    cpu_fused.rope_(qkv, positions, rotary.inv_freq, heads, kv_heads, head_dim)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    torch.testing.assert_close(q.reshape(tokens, heads, head_dim), expected_q, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        k.reshape(tokens, kv_heads, head_dim), expected_k, atol=2e-5, rtol=1e-5
    )
    assert torch.equal(v, expected_v)


@pytest.mark.parametrize("rows, inter", [(5, 48), (3, 61), (1, 7), (9, 640)])
@pytest.mark.parametrize(
    "activation, reference",
    [("silu", F.silu), ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh"))],
)
def test_gated_mul(rows, inter, activation, reference):
    """Odd widths run the vector loop and its scalar tail; large gates of both signs saturate."""
    gate_up = torch.randn(rows, 2 * inter, generator=GEN) * 4
    gate_up[0, :3] = torch.tensor([-60.0, 60.0, 0.0])[: min(3, inter)]
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(cpu_fused.gated_mul(gate_up, activation), reference(gate) * up)


def test_usable_only_for_float32_cpu(monkeypatch):
    assert not cpu_fused.usable(torch.zeros(2, dtype=torch.bfloat16))
    monkeypatch.setattr(cpu_fused.native, "DISABLED", True)
    assert not cpu_fused.usable(torch.zeros(2))


def test_mlp_in_row_blocks_equals_one_pass():
    """A long prefill's MLP runs in blocks of rows on the CPU; the result is the one-pass result."""
    from plait.runtime.models import layers

    args = ModelArgs(
        vocab_size=10,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10000.0,
    )
    mlp = layers.MLP(args)
    x = torch.randn(23, 32, generator=GEN)
    whole = mlp(x, NativeCpuOps(block_rows=None))
    torch.testing.assert_close(mlp(x, NativeCpuOps(block_rows=5)), whole)
    gate, up = mlp.gate_up_proj(x).split(48, dim=-1)
    torch.testing.assert_close(whole, mlp.down_proj(F.silu(gate) * up), atol=1e-5, rtol=1e-5)
