"""The embedded model quantized (weights, and separately the KV cache): greedy int8 and int4 (both
run the GGUF's own Q4_1 blocks, its Q8_0 embedding as the int8 LM head; see docs/cpu.md) agree
with float32 on at least 95% of tokens over a fixed set of prompts, as one batch and one at a
time (single rows and batches take different kernels)."""

from __future__ import annotations

import pytest

from plait import Engine

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nList three colors.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at 100 degrees Celsius. At high altitude,",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 5, 8, 13,",
]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


# (engine keyword, value, the stat that shrinks, by at least this factor)
COMPACT = [
    ("quantization", "int8", "weight_bytes", 3),
    ("quantization", "int4", "weight_bytes", 3),
    ("kv_cache_dtype", "bfloat16", "kv_bytes_per_token", 2),
    ("kv_cache_dtype", "int8", "kv_bytes_per_token", 2),
]


@pytest.mark.parametrize("key,value,stat,factor", COMPACT, ids=lambda v: str(v))
def test_compact_formats_greedy_agrees_with_float32(default_engine, key, value, stat, factor):
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    ref = [o["output_ids"] for o in default_engine.generate(PROMPTS, sampling_params=params)]
    with Engine(**{key: value}, max_total_tokens=8192) as engine:
        ours = [o["output_ids"] for o in engine.generate(PROMPTS, sampling_params=params)]
        # one at a time too: single rows and batches of rows take different kernels
        alone = [engine.generate(p, sampling_params=params)["output_ids"] for p in PROMPTS]
        stats = engine.stats()
    assert agreement(ours, ref) >= 0.95, (ours, ref)
    assert agreement(alone, ref) >= 0.95, (alone, ref)
    assert stats[stat] <= default_engine.stats()[stat] / factor
