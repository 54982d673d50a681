"""Verification keeps the target distribution: greedy exactness and rejection sampling."""

from __future__ import annotations

import pytest
import torch

from plait.runtime.protocol import SamplingParams
from plait.runtime.sampling import SamplingRow
from plait.runtime.speculative.ngram import NgramIndex
from plait.runtime.speculative.verify import target_probs, verify_draft

V = 12


def row(seed: int = 0, **params) -> SamplingRow:
    sp = SamplingParams(**params)
    sp.validate()
    return SamplingRow(sp, [], [], [], torch.Generator().manual_seed(seed))


def no_mask(i, logits) -> None:
    return None


def test_greedy_accepts_the_argmax_run_plus_one():
    logits = torch.full((4, V), -5.0)
    logits[0, 3] = logits[1, 7] = logits[2, 1] = logits[3, 9] = 5.0
    r = row(temperature=0.0)
    assert verify_draft(logits.clone(), [3, 7, 1], lambda i: r, no_mask) == [3, 7, 1, 9]
    assert verify_draft(logits.clone(), [3, 8, 1], lambda i: r, no_mask) == [3, 7]
    assert verify_draft(logits.clone(), [4, 7, 1], lambda i: r, no_mask) == [3]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 5
    return float((((counts - expected) ** 2) / expected)[keep].sum()), int(keep.sum()) - 1


@pytest.mark.parametrize(
    "params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 6, "top_p": 0.9}]
)
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(params, with_draft_probs):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=gen) * 1.5
    p = target_probs(logits[0].clone(), row(**params))
    q = torch.softmax(torch.randn(V, generator=gen), -1)
    draft_probs = q[None] if with_draft_probs else None
    r = row(seed=1, **params)
    counts = torch.zeros(V)
    draws = 6000
    for _ in range(draws):
        # the draft token itself follows q (or is a fixed guess for a deterministic drafter)
        d = int(torch.multinomial(q, 1, generator=gen)) if with_draft_probs else 2
        out = verify_draft(logits.clone(), [d], lambda i: r, no_mask, draft_probs)
        counts[out[0]] += 1
    stat, dof = chi_square(counts, p)
    # 99.9% quantile of chi-square with <= 11 degrees of freedom is < 32
    assert stat < 32, (stat, dof, counts / draws, p)


def test_target_probs_are_the_same_with_and_without_the_native_kernels(monkeypatch):
    from plait.kernels import native

    logits = torch.randn(3000, generator=torch.Generator().manual_seed(4)) * 2
    settings = [
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.2, "top_k": 40, "min_p": 0.01},
    ]
    dead = torch.full(
        (V,), float("-inf")
    )  # no finite distribution: the argmax alone, as `sample` takes it
    native_probs = [target_probs(logits.clone(), row(**s)) for s in settings]
    assert target_probs(dead.clone(), row(temperature=1.0)).tolist() == [1.0] + [0.0] * (V - 1)
    monkeypatch.setattr(native, "DISABLED", True)
    for s, got in zip(settings, native_probs):
        ref = target_probs(logits.clone(), row(**s))
        assert torch.equal(got > 0, ref > 0)
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-4)
    assert target_probs(dead.clone(), row(temperature=1.0)).tolist() == [1.0] + [0.0] * (V - 1)


def test_ngram_index_proposes_the_latest_continuation():
    ids = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6]
    index = NgramIndex(max_n=3)
    assert index.lookup(ids, 3, min_n=1) == [7, 9, 2]  # "5 6" last continued with "7 9 2"
    ids += [7, 9]
    assert index.lookup(ids, 2, min_n=1) == [2, 5]
    assert NgramIndex(3).lookup([1, 2, 3], 2, min_n=1) == []


def test_ngram_index_follows_a_request_by_its_new_tokens():
    prompt, output = [5, 6, 7, 8, 1, 5, 6], []
    index = NgramIndex(max_n=3)
    for token in [7, 9, 2, 5, 6, 7]:
        ids = index.sync(prompt, output)
        assert ids == prompt + output
        assert index.lookup(ids, 3, min_n=1) == NgramIndex(3).lookup(prompt + output, 3, min_n=1)
        output.append(token)
    output[-1] = 42  # the tokens changed under it: it starts over
    assert index.sync(prompt, output) == prompt + output
    assert index.lookup(index.ids, 2, min_n=1) == NgramIndex(3).lookup(prompt + output, 2, min_n=1)
    assert index.sync(prompt, output[:2]) == prompt + output[:2]


def test_request_ids_between_equals_slicing_all_ids():
    from plait.runtime.request import Request, SamplingState

    req = Request(rid="r", prompt_ids=[1, 2, 3, 4], sampling=SamplingState(SamplingParams()))
    req.output_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 8):
            assert req.ids_between(start, end) == req.all_ids[start:end], (start, end)
