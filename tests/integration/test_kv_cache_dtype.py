"""Engines whose KV cache stores bfloat16 or scaled int8: more tokens fit in the same memory,
prompt logprobs and greedy outputs stay close to a float32 cache, and cached prefixes (read back
from the compact pages) still decode under the engine's page invariants."""

from __future__ import annotations

import pytest

from plait import Engine
from tests.integration.test_quantized_engine import PROMPTS, prompt_logprobs


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    made = {
        kv: Engine(
            model_path=str(tiny_llama_dir),
            kv_cache_dtype=kv,
            mem_fraction_static=0.0001,
            page_size=4,
            check_invariants=True,
        )
        for kv in ("float32", "bfloat16", "int8")
    }
    yield made
    for engine in made.values():
        engine.shutdown()


def test_compact_caches_hold_more_tokens(engines):
    stats = {kv: e.stats() for kv, e in engines.items()}
    assert [stats[kv]["kv_cache_dtype"] for kv in engines] == ["float32", "bfloat16", "int8"]
    per_token = {kv: s["kv_bytes_per_token"] for kv, s in stats.items()}
    assert per_token["bfloat16"] * 2 == per_token["float32"]
    d = engines["int8"].args.head_dim  # int8: head_dim bytes and one float32 scale per head
    assert per_token["float32"] * (d + 4) == per_token["int8"] * 4 * d
    pages = {kv: s["kv_pages_total"] for kv, s in stats.items()}
    cap = 64 * engines["int8"].context_len // 4  # the pool never exceeds 64 full contexts
    if pages["float32"] * 4 > cap:  # a machine with much more memory than CI's 24 GiB
        pytest.skip("the pool cap binds before the memory budget")
    assert pages["bfloat16"] >= 1.95 * pages["float32"]
    assert pages["int8"] >= 0.98 * pages["float32"] * 4 * d / (d + 4)


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_compact_cache_logprobs_and_greedy_stay_close(engines, kv):
    # a long prompt whose later tokens read the earlier ones back from the (compact) cache
    for ids in PROMPTS:
        ours, ref = prompt_logprobs(engines[kv], ids), prompt_logprobs(engines["float32"], ids)
        assert max(abs(a - b) for a, b in zip(ours, ref)) < 0.05
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    ref = [
        o["output_ids"]
        for o in engines["float32"].generate(input_ids=PROMPTS, sampling_params=params)
    ]
    ours = [
        o["output_ids"] for o in engines[kv].generate(input_ids=PROMPTS, sampling_params=params)
    ]
    same = sum(a == b for x, y in zip(ours, ref) for a, b in zip(x, y))
    assert same / sum(map(len, ref)) >= 0.9, (ours, ref)


def test_int8_cache_prefix_hits_decode_like_a_cold_run(engines):
    """The second request reads its whole prompt from int8 pages; its output equals the first's."""
    engine = engines["int8"]
    prompt = list(range(300, 420))
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    first = engine.generate(input_ids=prompt, sampling_params=params)
    second = engine.generate(input_ids=prompt, sampling_params=params)
    assert second["meta_info"]["cached_tokens"] > 100
    assert second["output_ids"] == first["output_ids"]


def test_unknown_kv_cache_dtype_is_named(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(model_path=str(tiny_llama_dir), kv_cache_dtype="fp8")


def test_auto_cache_is_bfloat16_for_quantized_weights_on_the_cpu(tiny_llama_dir):
    """ "auto" is the model's dtype (float32 on the CPU), but int8 / int4 weights get a bfloat16
    cache, as llama.cpp keeps a quantized GGUF's in float16; an explicit dtype always wins."""
    cases = [
        ({}, "float32"),
        ({"quantization": "int4"}, "bfloat16"),
        ({"quantization": "int8"}, "bfloat16"),
        ({"quantization": "int4", "kv_cache_dtype": "float32"}, "float32"),
    ]
    for kwargs, expected in cases:
        with Engine(model_path=str(tiny_llama_dir), max_total_tokens=256, **kwargs) as engine:
            assert engine.stats()["kv_cache_dtype"] == expected, kwargs
            out = engine.generate(
                input_ids=list(range(40, 70)), sampling_params={"max_new_tokens": 4}
            )
            assert len(out["output_ids"]) == 4
