"""The sampler objects (`runtime/sampling.py`): `choose_sampler` picks one per device and dtype,
each reports the name `Execution.describe` shows, and one built once draws the tokens the per-call
`sample` draws, greedy picks included."""

from __future__ import annotations

import pytest
import torch

from plait.kernels import native, sampling_cpu
from plait.runtime import sampling
from plait.runtime.protocol import SamplingParams
from plait.runtime.sampling import (
    NativeSampler,
    SamplingRow,
    TorchCpuSampler,
    TritonSampler,
    argmax_cpu,
    choose_sampler,
    sample,
)

CPU = torch.device("cpu")


def rows(seed: int) -> list[SamplingRow]:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=20),
        SamplingParams(temperature=1.1, top_p=0.8, repetition_penalty=1.2),
    ]
    return [
        SamplingRow(p, [3, 4], [1], [], torch.Generator().manual_seed(seed + i))
        for i, p in enumerate(params)
    ]


def test_the_cpu_sampler_is_native_where_it_built(monkeypatch) -> None:
    chosen = choose_sampler(CPU)
    if sampling_cpu.available():
        assert isinstance(chosen, NativeSampler) and chosen.name == "native"
    else:
        assert isinstance(chosen, TorchCpuSampler) and chosen.name == "torch"
    assert choose_sampler(CPU, torch.bfloat16).name == "torch"
    monkeypatch.setattr(native, "DISABLED", True)
    assert type(choose_sampler(CPU)) is TorchCpuSampler
    assert choose_sampler(CPU).argmax is argmax_cpu  # the greedy pick, bound for the device


def test_triton_is_chosen_where_it_runs(monkeypatch) -> None:
    monkeypatch.setattr(sampling, "use_triton", lambda t: True)
    chosen = choose_sampler(CPU)
    assert isinstance(chosen, TritonSampler) and chosen.name == "triton"


@pytest.mark.parametrize("disabled", [False, True])
def test_a_sampler_built_once_draws_what_sample_draws(monkeypatch, disabled: bool) -> None:
    monkeypatch.setattr(native, "DISABLED", disabled)
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 3
    sampler = choose_sampler(CPU)
    once = [sampler.sample(logits.clone(), rows(seed)).tolist() for seed in range(10)]
    per_call = [sample(logits.clone(), rows(seed)).tolist() for seed in range(10)]
    assert once == per_call
    assert {r[0] for r in once} == {int(logits[0].argmax())}  # the greedy row
    assert len({r[1] for r in once}) > 1  # the sampled rows vary with the seed
