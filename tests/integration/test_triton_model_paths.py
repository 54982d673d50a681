"""The model's Triton paths (RMSNorm, residual add + RMSNorm, rotary embedding, sampling), which
CUDA tensors take, run end to end through an Engine on the CPU in Triton's interpreter: the layer
operations' chooser's and the sampler's `use_triton` are forced on (and the native CPU kernels off,
which the chooser would otherwise prefer for float32 on the CPU). Greedy tokens equal the torch
path's; seeded sampling is reproducible (tests/unit/test_sampling_triton_path.py checks what the
draws may be)."""

from __future__ import annotations

import pytest

from plait.kernels import native

pytest.importorskip("triton")

PROMPTS = ["The capital of France is", "1, 2, 3,"]


def _generate(model_dir, params):
    from plait import Engine

    engine = Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        max_total_tokens=1024,
        page_size=4,
        num_continuous_decode_steps=1,
    )
    try:
        outs = engine.generate(PROMPTS, sampling_params=params)
        return engine.stats()["execution_layer_ops"], [o["output_ids"] for o in outs]
    finally:
        engine.shutdown()


@pytest.fixture
def triton_paths(monkeypatch):
    from plait.kernels import layer_ops
    from plait.runtime import sampling

    calls = {"norm": 0, "rotary": 0, "sample": 0}
    norm_rope = layer_ops.norm_rope

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(native, "DISABLED", True)
    monkeypatch.setattr(layer_ops, "use_triton", lambda t: True)
    monkeypatch.setattr(sampling, "use_triton", lambda t: True)
    monkeypatch.setattr(norm_rope, "rms_norm_triton", counting("norm", norm_rope.rms_norm_triton))
    monkeypatch.setattr(
        norm_rope,
        "fused_add_rms_norm_triton",
        counting("norm", norm_rope.fused_add_rms_norm_triton),
    )
    monkeypatch.setattr(norm_rope, "rotary_triton", counting("rotary", norm_rope.rotary_triton))
    monkeypatch.setattr(sampling, "sample_triton", counting("sample", sampling.sample_triton))
    return calls


def test_greedy_tokens_equal_the_torch_path(tiny_llama_dir, monkeypatch, triton_paths) -> None:
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    ops, ours = _generate(tiny_llama_dir, params)
    assert ops == "triton" and triton_paths["norm"] > 0 and triton_paths["rotary"] > 0
    monkeypatch.undo()
    monkeypatch.setattr(native, "DISABLED", True)  # the same torch references on both sides
    assert _generate(tiny_llama_dir, params) == ("torch", ours)


def test_seeded_sampling_is_reproducible_and_filtered(tiny_llama_dir, triton_paths) -> None:
    params = {"max_new_tokens": 3, "temperature": 1.0, "top_k": 5, "seed": 7, "ignore_eos": True}
    _, first = _generate(tiny_llama_dir, params)
    assert triton_paths["sample"] > 0
    assert _generate(tiny_llama_dir, params)[1] == first
    assert all(len(ids) == 3 for ids in first)
