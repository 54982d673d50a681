"""Sampling never leaves its support, seeds reproduce, penalties act as defined."""

from __future__ import annotations

import pytest
import torch

from plait.runtime.protocol import SamplingParams
from plait.runtime.sampling import SamplingRow, apply_penalties, argmax, sample

VOCAB = 50


def rows(
    n: int, seed: int | None = 0, output_ids=(), prompt_ids=(), banned=(), **params
) -> list[SamplingRow]:
    sp = SamplingParams(**params)
    sp.validate()
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return [
        SamplingRow(sp, list(output_ids), list(prompt_ids), list(banned), gen) for _ in range(n)
    ]


def draws(logits: torch.Tensor, n: int, **params) -> torch.Tensor:
    batch = logits.repeat(n, 1)
    return sample(batch, rows(n, **params))


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 2


def test_greedy_is_argmax(logits):
    assert draws(logits, 4, temperature=0.0).tolist() == [logits.argmax().item()] * 4


def test_argmax_is_torchs_first_maximum_with_ties_and_nan():
    x = torch.tensor(
        [[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0], [1.0, float("nan"), 5.0, float("nan")]]
    )
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist() == [1, 0, 1]
    assert argmax(x).dtype == torch.long
    assert argmax(x[0]).item() == 1  # one row
    assert (
        argmax(x.t()[:2]).tolist() == x.t()[:2].argmax(dim=-1).tolist()
    )  # not contiguous: torch's
    big = torch.randn(3, 49152, generator=torch.Generator().manual_seed(1))
    assert torch.equal(argmax(big), big.argmax(dim=-1))


def test_top_k_support(logits):
    allowed = set(logits[0].topk(5).indices.tolist())
    got = set(draws(logits, 3000, top_k=5).tolist())
    assert got <= allowed and len(got) == 5


def test_top_p_support(logits):
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    keep = int((cum < 0.6).sum().item()) + 1  # smallest prefix whose mass reaches 0.6
    allowed = set(order[:keep].tolist())
    got = set(draws(logits, 3000, top_p=0.6).tolist())
    assert got <= allowed and len(got) == len(allowed)


def test_min_p_support(logits):
    probs = logits[0].softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    got = set(draws(logits, 3000, min_p=0.2).tolist())
    assert got <= allowed and len(got) == len(allowed)


def test_temperature_sharpens(logits):
    hot = draws(logits, 2000, temperature=2.0)
    cold = draws(logits, 2000, temperature=0.3)
    assert len(set(cold.tolist())) < len(set(hot.tolist()))


def test_seed_reproduces_and_differs(logits):
    a = sample(logits.repeat(1, 1).clone(), rows(1, seed=7))
    first = [sample(logits.clone(), rows(1, seed=7)).item() for _ in range(5)]
    again = [sample(logits.clone(), rows(1, seed=7)).item() for _ in range(5)]
    assert first == again and a.item() == first[0]
    seq = rows(1, seed=11)
    s1 = [sample(logits.clone(), seq).item() for _ in range(20)]
    seq = rows(1, seed=12)
    s2 = [sample(logits.clone(), seq).item() for _ in range(20)]
    assert s1 != s2


def test_frequency_and_presence_penalties():
    logits = torch.zeros(1, VOCAB)
    apply_penalties(
        logits, rows(1, output_ids=[3, 3, 5], frequency_penalty=0.5, presence_penalty=0.25)
    )
    assert logits[0, 3].item() == pytest.approx(-0.5 * 2 - 0.25)
    assert logits[0, 5].item() == pytest.approx(-0.5 - 0.25)
    assert logits[0, 4].item() == 0.0


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 9] = 2.0, -2.0, 2.0
    apply_penalties(logits, rows(1, prompt_ids=[1], output_ids=[2], repetition_penalty=2.0))
    assert logits[0, 1].item() == 1.0 and logits[0, 2].item() == -4.0 and logits[0, 9].item() == 2.0


def test_banned_ids_are_never_sampled(logits):
    top = logits.argmax().item()
    got = draws(logits, 500, banned=[top], temperature=0.0)
    assert top not in got.tolist()


@pytest.mark.parametrize(
    "params, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop": 5}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"bogus": 1}, "bogus"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_bad_params_name_the_key(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params)
