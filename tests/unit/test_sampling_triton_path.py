"""`runtime/sampling.sample` on its Triton path (the one CUDA logits take), run on the CPU in
Triton's interpreter by forcing the sampler's `use_triton`: greedy rows keep the argmax, sampled
rows stay inside their filtered set, seeds reproduce, and a row with no finite distribution keeps
its argmax."""

from __future__ import annotations

import pytest
import torch

from plait.runtime import sampling
from plait.runtime.protocol import SamplingParams
from plait.runtime.sampling import SamplingRow, sample

pytest.importorskip("triton")

VOCAB = 300


def row(seed: int, **params) -> SamplingRow:
    sp = SamplingParams(**params)
    sp.validate()
    return SamplingRow(sp, [], [], [], torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def triton_path(monkeypatch):
    calls = []
    real = sampling.sample_triton
    monkeypatch.setattr(sampling, "use_triton", lambda t: True)
    monkeypatch.setattr(sampling, "sample_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_rows_stay_in_their_support_and_seeds_reproduce(triton_path) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=3),
        dict(temperature=0.8, top_p=0.5),
        dict(temperature=1.2, min_p=0.2),
    ]

    def draw(seed: int) -> list[int]:
        return sample(logits.clone(), [row(seed + i, **p) for i, p in enumerate(params)]).tolist()

    first = draw(1)
    assert triton_path
    assert first == draw(1)
    assert first[0] == logits[0].argmax().item()
    assert first[1] in logits[1].topk(3).indices.tolist()
    probs = torch.softmax(logits[2] / 0.8, -1)
    order = probs.argsort(descending=True)
    nucleus = order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist()
    assert first[2] in nucleus
    p3 = torch.softmax(logits[3] / 1.2, -1)
    assert p3[first[3]] >= 0.2 * p3.max()
    picks = {tuple(draw(s))[1] for s in range(12)}
    assert len(picks) > 1  # it does sample


def test_a_row_without_a_finite_distribution_keeps_its_argmax() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[0, 5] = float("nan")
    expected = sampling.argmax(logits.clone())[0].item()
    out = sample(logits, [row(0, temperature=1.0), row(1, temperature=1.0)]).tolist()
    assert out[0] == expected and 0 <= out[1] < VOCAB
