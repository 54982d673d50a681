"""Engines with weight-only quantization on a tiny model: the linears are swapped, the weights a
step reads shrink, prompt logprobs stay close to float32, and generation runs under the engine's
page invariants. GGUF files keep their blocks (see test_gguf_loader)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait import Engine
from plait.runtime.models.quantized import QuantLinear

PROMPTS = [[5, 17, 300, 4000, 12, 9, 81], [1000, 2000, 3000], list(range(40, 90))]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    made = {
        mode: Engine(
            model_path=str(tiny_llama_dir),
            quantization=mode,
            max_total_tokens=2048,
            page_size=4,
            check_invariants=True,
        )
        for mode in (None, "int8", "int4")
    }
    yield made
    for engine in made.values():
        engine.shutdown()


def prompt_logprobs(engine: Engine, ids: list[int]) -> list[float]:
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    return [entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]]


def test_quantized_prompt_logprobs_stay_close_to_float32(engines):
    """Errors are bounded, and int8 (256 levels per row) beats int4 (16 per group of 32)."""
    worst = {}
    for mode in ("int8", "int4"):
        worst[mode] = max(
            abs(a - b)
            for ids in PROMPTS
            for a, b in zip(
                prompt_logprobs(engines[mode], ids), prompt_logprobs(engines[None], ids)
            )
        )
    assert worst["int8"] < 0.1 and worst["int4"] < 1.0, worst
    assert worst["int8"] < worst["int4"], worst


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engine_swaps_linears_and_reports_weight_bytes(engines, mode):
    engine = engines[mode]
    quantized = [m for m in engine.core.model.modules() if isinstance(m, QuantLinear)]
    # qkv, o, gate_up, down per layer, and the LM head
    assert len(quantized) == 4 * engine.args.num_layers + 1
    assert {m.format for m in quantized} == {mode}
    stats = engine.stats()
    assert stats["quantization"] == mode
    full = engines[None].stats()["weight_bytes"]
    assert stats["weight_bytes"] < full * (0.3 if mode == "int8" else 0.2)
    outs = engine.generate(
        input_ids=PROMPTS,
        sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    )
    assert [len(o["output_ids"]) for o in outs] == [12, 12, 12]


def test_unknown_quantization_is_named(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization"):
        Engine(model_path=str(tiny_llama_dir), quantization="fp8")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_tensors_are_what_a_step_reads_and_read_back(engines, mode):
    from plait.kernels.roofs import read_seconds
    from plait.runtime.models.quantized import weight_tensors

    engine = engines[mode]
    tensors = weight_tensors(engine.core.model)
    assert sum(t.nbytes for t in tensors) == engine.stats()["weight_bytes"]
    ptrs = {t.data_ptr() for t in tensors}
    for m in engine.core.model.modules():
        if isinstance(m, QuantLinear):  # packed weights, scales (and int4 minimums)
            assert {t.data_ptr() for t in (m.qweight, m.scales, m.qw.mins) if t is not None} <= ptrs
    seconds = read_seconds(tensors, repeats=2)
    if seconds is not None:  # the native kernels built
        assert seconds > 0
        with pytest.raises(ValueError, match=r"tensors\[1\]"):
            read_seconds([tensors[0], torch.ones(4, 4).t()])


def test_the_throughput_bench_roofs_measure(engines):
    """The int8 dot products' peak (the throughput bench's compute roof) is a finite rate, and a
    token's weight multiply-adds are the model's, whatever the weights' format."""
    from plait.benchmarks.roofline import weight_macs
    from plait.kernels.roofs import int8_macs_per_second

    peak = int8_macs_per_second(seconds=0.05)
    assert peak is None or 0 < peak < float("inf")  # None: no native kernels
    int8, int4 = (weight_macs(engines[mode].core.model) for mode in ("int8", "int4"))
    args = engines["int8"].core.args
    assert int8 == int4 > args.hidden_size * args.vocab_size  # the head and the layers


def test_prefill_attends_in_bfloat16_where_quantized_matmuls_multiply_in_it(
    tiny_llama_dir, monkeypatch
):
    """Quantized models on a CPU whose GEMM has AMX (forced on here) prefill in bfloat16, attention
    included; float32 models do not. Prompt logprobs stay within bfloat16 rounding of the float32
    attention's."""
    from plait.kernels import quant_matmul

    monkeypatch.setattr(quant_matmul, "bf16_gemm_enabled", lambda: True)
    monkeypatch.setattr(quant_matmul, "bf16_gemm_min_rows", lambda: quant_matmul.BF16_GEMM_MIN_ROWS)
    monkeypatch.setattr(quant_matmul, "bf16_extends_enabled", lambda: True)
    with (
        Engine(
            model_path=str(tiny_llama_dir), quantization="int4", max_total_tokens=1024
        ) as quantized,
        Engine(model_path=str(tiny_llama_dir), max_total_tokens=1024) as full,
    ):
        assert quantized.core.runner.bf16_extends and not full.core.runner.bf16_extends
        ids = (
            PROMPTS[2] * 4
        )  # 200 tokens: one chunk with BF16_EXTEND_MIN_WORK (new tokens x keys) and more
        bf16 = prompt_logprobs(quantized, ids)
        quantized.flush_cache()
        runner = quantized.core.runner
        runner.execution = dataclasses.replace(runner.execution, bf16_extends=False)
        native = prompt_logprobs(quantized, ids)
        assert max(abs(a - b) for a, b in zip(bf16, native)) < 0.05
        assert bf16 != native  # the bfloat16 attention did run
