"""The native CPU sampler (`kernels/sampling_cpu.py`) against the torch reference: the kept set of
`filter_probs_ref` and the inverse-CDF draw of `draw_ref`, token for token; its edge cases; and
`runtime/sampling.sample` picking the same tokens with the native kernels disabled."""

from __future__ import annotations

import pytest
import torch

from plait.kernels import native, sampling_cpu
from plait.kernels.sampling_triton import filter_probs_ref
from plait.runtime.protocol import SamplingParams
from plait.runtime.sampling import SamplingRow, sample

pytestmark = pytest.mark.skipif(
    not sampling_cpu.available(), reason="native CPU kernels did not build"
)

SETTINGS = [  # temperature, top_k, top_p, min_p
    (1.0, None, 1.0, 0.0),
    (0.7, None, 0.9, 0.0),
    (1.3, 20, 1.0, 0.0),
    (1.0, None, 1.0, 0.05),
    (0.5, 100, 0.5, 0.01),
    (1.0, 1, 1.0, 0.0),
    (1.0, None, 0.0, 0.0),
]


def _reference(logits: torch.Tensor, t: float, k: int, p: float, m: float) -> torch.Tensor:
    probs = torch.softmax(logits.double() / t, dim=-1).float()
    one = lambda x, dtype: torch.tensor([x], dtype=dtype)  # noqa: E731
    return filter_probs_ref(
        probs, one(k, torch.long), one(p, torch.float32), one(m, torch.float32)
    )[0].double()


def _native(
    logits: torch.Tensor, t: float, k: int, p: float, m: float, uniforms: torch.Tensor
) -> torch.Tensor:
    n = uniforms.numel()
    rows = logits.expand(n, -1)
    full = lambda x, dtype: torch.full((n,), x, dtype=dtype)  # noqa: E731
    return sampling_cpu.sample_rows(
        rows,
        full(t, torch.float32),
        full(k, torch.long),
        full(p, torch.float32),
        full(m, torch.float32),
        uniforms,
    )


def _logits(vocab: int, seed: int, crowded: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, vocab, generator=gen) * 2
    if crowded:  # most of the mass spread over thousands of nearly equal tokens: one crowded bucket
        logits[0, 100:4100] = 3.0 + torch.rand(4000, generator=gen) * 1e-3
    return logits


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
@pytest.mark.parametrize("vocab,crowded", [(5000, False), (49152, False), (6000, True)])
def test_draws_match_the_reference_token_for_token(setting, vocab, crowded) -> None:
    t, k, p, m = setting
    k = vocab if k is None else k
    logits = _logits(vocab, seed=vocab + int(crowded), crowded=crowded)
    ref = _reference(logits, t, k, p, m)
    kept = ref > 0
    # a uniform at the middle of each token's slice of the CDF (slices too thin to hit reliably
    # through float rounding left out) must pick that very token
    cum = ref.cumsum(0)
    wide = (ref > 1e-4 * ref.max()).nonzero().flatten()
    if len(wide) > 256:  # spread over the vocabulary, and the least likely kept ones (the edge)
        spread = wide[torch.linspace(0, len(wide) - 1, 192).long()]
        wide = torch.cat([spread, wide[ref[wide].argsort()[:64]]]).unique()
    middles = ((cum[wide] - ref[wide] / 2) / cum[-1]).float()
    assert torch.equal(_native(logits, t, k, p, m, middles), wide)
    assert torch.equal(sampling_cpu.draw_ref(ref[None].expand(len(middles), -1), middles), wide)
    # random draws never leave the kept set
    picks = _native(
        logits, t, k, p, m, torch.rand(2000, generator=torch.Generator().manual_seed(1))
    )
    assert kept[picks].all()
    if k == 1 or p == 0.0:
        assert (picks == logits.argmax()).all()


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
@pytest.mark.parametrize("vocab,crowded", [(5000, False), (49152, False), (6000, True)])
def test_filtered_probs_equal_the_reference(setting, vocab, crowded) -> None:
    t, k, p, m = setting
    k = vocab if k is None else k
    logits = _logits(vocab, seed=vocab + int(crowded), crowded=crowded)[0]
    ref = _reference(logits[None], t, k, p, m)
    got = sampling_cpu.filtered_probs(logits.clone(), t, k, p, m)
    assert torch.equal(got > 0, ref > 0)  # the very same kept set
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-4)
    assert abs(float(got.double().sum()) - 1.0) < 1e-5


def test_filtered_probs_of_rows_without_a_finite_distribution_are_none() -> None:
    nan, none = torch.zeros(64), torch.full((64,), float("-inf"))
    nan[5] = float("nan")
    assert sampling_cpu.filtered_probs(nan, 1.0, -1, 1.0, 0.0) is None
    assert sampling_cpu.filtered_probs(none, 1.0, -1, 1.0, 0.0) is None
    with pytest.raises(ValueError, match="temperature"):
        sampling_cpu.filtered_probs(torch.zeros(8), 0.0, -1, 1.0, 0.0)
    with pytest.raises(ValueError, match="logits"):
        sampling_cpu.filtered_probs(torch.zeros(2, 8), 1.0, -1, 1.0, 0.0)


def test_draws_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0]]))
    picks = _native(
        logits, 1.0, 5, 1.0, 0.0, torch.rand(20000, generator=torch.Generator().manual_seed(2))
    )
    freq = torch.bincount(picks, minlength=5).double() / 20000
    assert freq[4] == 0
    torch.testing.assert_close(
        freq[:4], torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), atol=0.015, rtol=0
    )


def test_rows_without_a_finite_distribution_return_minus_one() -> None:
    logits = torch.zeros(3, 64)
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")
    logits[2, :] = float("-inf")
    logits[2, 9] = 1.0  # one finite logit: always that token
    ones = torch.ones(3)
    out = sampling_cpu.sample_rows(
        logits, ones, torch.full((3,), 64), ones, torch.zeros(3), torch.full((3,), 0.99)
    )
    assert out.tolist() == [-1, -1, 9]


def test_equal_probabilities_keep_the_lowest_indices() -> None:
    logits = torch.zeros(1, 1000)
    picks = _native(logits, 1.0, 3, 1.0, 0.0, torch.linspace(0, 0.999, 50))
    assert set(picks.tolist()) == {0, 1, 2}


def test_bad_arguments_name_the_argument() -> None:
    logits, one = torch.zeros(2, 8), torch.ones(2)
    k = torch.full((2,), 8)
    with pytest.raises(ValueError, match="uniforms"):
        sampling_cpu.sample_rows(logits, one, k, one, one * 0, torch.rand(3))
    with pytest.raises(ValueError, match="temperature"):
        sampling_cpu.sample_rows(logits, one * 0, k, one, one * 0, torch.rand(2))
    with pytest.raises(ValueError, match="logits"):
        sampling_cpu.sample_rows(logits.double(), one, k, one, one * 0, torch.rand(2))


def test_sample_picks_the_same_tokens_without_the_native_kernels(monkeypatch) -> None:
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=1),
        SamplingParams(temperature=1.0, top_k=40, max_new_tokens=1),
        SamplingParams(temperature=0.0, max_new_tokens=1),
        SamplingParams(temperature=1.2, min_p=0.02, max_new_tokens=1),
    ]
    logits = torch.cat([_logits(3000, seed=i) for i in range(len(params))])

    def run() -> list[int]:
        picks = []
        for step in range(20):
            rows = [
                SamplingRow(
                    params=p,
                    output_ids=[],
                    prompt_ids=[],
                    banned_ids=[],
                    generator=torch.Generator().manual_seed(100 * step + i),
                )
                for i, p in enumerate(params)
            ]
            picks += sample(logits.clone(), rows).tolist()
        return picks

    with_native = run()
    monkeypatch.setattr(native, "DISABLED", True)
    assert not sampling_cpu.available()
    assert run() == with_native
    assert len(set(with_native[0::4])) > 1  # the sampled rows do vary with the seed
