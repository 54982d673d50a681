"""The backend objects an engine chooses at start are the ones its steps call: the sampler
(`Execution.sampling`, named in `execution_sampling`), the page tables' attention layouts and
each quantized weight's products."""

from __future__ import annotations

import pytest
import torch

from plait import Engine
from plait.kernels import quant_matmul as qm
from plait.kernels.quant_weights import quantize_int8
from plait.runtime import sampling


def test_steps_sample_with_the_sampler_chosen_at_start(tiny_llama_dir, monkeypatch) -> None:
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=1024) as engine:
        runner = engine.core.runner
        sampler = runner.execution.sampling
        assert runner.tokens.sampler is sampler
        assert engine.stats()["execution_sampling"] == sampler.name
        expected = sampling.choose_sampler(engine.device).name
        assert sampler.name == expected

        def no_choice(*args, **kwargs):
            raise AssertionError("a step chose a sampler")

        monkeypatch.setattr(sampling, "choose_sampler", no_choice)
        params = {"max_new_tokens": 3, "temperature": 1.0, "seed": 5, "ignore_eos": True}
        first = engine.generate(["Hello"], sampling_params=params)[0]["output_ids"]
        assert engine.generate(["Hello"], sampling_params=params)[0]["output_ids"] == first


def test_the_page_tables_attach_what_the_execution_chose(tiny_llama_dir) -> None:
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=1024) as engine:
        engine.generate(["Hi"], sampling_params={"max_new_tokens": 1})
        tables, attention = engine.core.runner.tables, engine.core.runner.execution.attention
        assert tables.attention == attention


@pytest.mark.skipif(not qm.native_quant_available(), reason="native CPU kernels did not build")
def test_a_quant_matmul_calls_its_bound_kernel(monkeypatch) -> None:
    qw = quantize_int8(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)))
    matmul = qm.QuantMatmul(qw)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    expected = matmul(x)
    assert matmul.describe() == qm.describe_paths(True)

    def no_lookup():
        raise AssertionError("a product looked the kernels up")

    monkeypatch.setattr(qm, "_kernels", no_lookup)
    assert torch.equal(matmul(x), expected)
    assert matmul.path(2) in ("int8 x", "float x")
