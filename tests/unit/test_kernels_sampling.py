"""Fused constrained sampling: the torch reference against plait's sampler, the Triton kernel
(interpreted on CPU; compiled on CUDA) against the reference, with the same exponential noise so
the draws compare exactly."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.constraint_mask import num_bitmask_words
from plait.kernels.sampling_triton import (
    exponential_noise,
    filter_probs_ref,
    sample_ref,
    sampling_probs_ref,
)
from plait.runtime.sampling import filter_probs

pytest.importorskip("triton")

from plait.kernels.sampling_triton import sample_triton, seeded_exponential_noise  # noqa: E402

# per row: (temperature, top_k (None = off), top_p, min_p)
ROW_PARAMS = [
    (0.0, None, 1.0, 0.0),  # greedy
    (1.0, None, 1.0, 0.0),  # plain softmax
    (0.7, 20, 1.0, 0.0),  # top-k
    (1.3, None, 0.8, 0.0),  # top-p
    (1.0, None, 1.0, 0.1),  # min-p
    (0.5, 5, 0.9, 0.05),  # all three
    (1.0, 1, 1.0, 0.0),  # top-k 1 is greedy by sampling
    (2.0, 100000, 0.3, 0.0),  # top-k wider than the vocabulary
]


def bit(b: int) -> int:
    """Word value with only bit b set, as an int32."""
    return -(2**31) if b == 31 else 1 << b


def make_case(batch: int, vocab: int, seed: int, constrained: bool, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    params = [ROW_PARAMS[i % len(ROW_PARAMS)] for i in range(batch)]
    temperature = torch.tensor([p[0] for p in params])
    top_k = torch.tensor([vocab if p[1] is None else min(p[1], vocab) for p in params])
    top_p = torch.tensor([p[2] for p in params])
    min_p = torch.tensor([p[3] for p in params])
    noise = exponential_noise(batch, vocab, [None] * batch, gen, "cpu")
    bitmask = None
    if constrained:
        words = num_bitmask_words(vocab)
        bitmask = torch.randint(
            -(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=gen
        )
        for row in range(batch):  # at least one allowed token per row
            token = (row * 7919) % vocab
            bitmask[row, token // 32] |= bit(token % 32)
        bitmask[0] = -1  # an unconstrained row among constrained ones
        if batch > 2:
            bitmask[2, :] = 0
            bitmask[2, (vocab - 1) // 32] = bit((vocab - 1) % 32)  # only the last token allowed
    tensors = (logits, temperature, top_k, top_p, min_p, noise, bitmask)
    return [None if t is None else t.to(device) for t in tensors]


def test_filter_reference_is_plaits_filter():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(8, 300, generator=gen) * 2, dim=-1)
    top_k = torch.tensor([300, 5, 300, 1, 50, 300, 300, 2])
    top_p = torch.tensor([1.0, 1.0, 0.5, 1.0, 0.9, 0.0, 1.0, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.01, 0.0, 0.2, 0.0])
    for rows in (slice(0, 1), slice(0, 3), slice(None)):
        args = (probs[rows], top_k[rows], top_p[rows], min_p[rows])
        assert torch.equal(filter_probs_ref(*args), filter_probs(*args))


def test_reference_draw_follows_the_distribution():
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(1)).repeat(20000, 1)
    n = logits.shape[0]
    args = (torch.full((n,), 1.0), torch.full((n,), 4), torch.full((n,), 1.0), torch.zeros(n))
    noise = exponential_noise(n, 6, [None] * n, torch.Generator().manual_seed(2), "cpu")
    ids = sample_ref(logits, *args, noise)
    freq = torch.bincount(ids, minlength=6).float() / n
    torch.testing.assert_close(freq, sampling_probs_ref(logits, *args)[0], atol=0.015, rtol=0)


def check(
    batch: int, vocab: int, seed: int, constrained: bool, device: str = "cpu", block_v: int = 1024
):
    logits, temperature, top_k, top_p, min_p, noise, bitmask = make_case(
        batch, vocab, seed, constrained, device
    )
    expected_probs = sampling_probs_ref(logits, temperature, top_k, top_p, min_p, bitmask)
    expected = sample_ref(logits, temperature, top_k, top_p, min_p, noise, bitmask)
    probs = torch.zeros(batch, vocab, device=device)
    actual = sample_triton(
        logits,
        temperature,
        top_k,
        top_p,
        min_p,
        noise=noise,
        bitmask=bitmask,
        probs_out=probs,
        block_v=block_v,
    )
    assert actual.tolist() == expected.tolist()
    # NOTE: the reference's cumsum may drop tail tokens of mass ~1e-8 that the kernel keeps
    torch.testing.assert_close(probs, expected_probs, atol=1e-6, rtol=1e-4)


# CPU, Triton interpreter -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch,vocab,block_v",
    [(8, 1, 1024), (8, 37, 1024), (8, 1000, 256), (3, 5003, 1024)],  # vocab not a multiple of 32
)
@pytest.mark.parametrize("constrained", [False, True])
def test_kernel_matches_reference(batch, vocab, block_v, constrained):
    check(batch, vocab, seed=vocab + batch, constrained=constrained, block_v=block_v)


def test_kernel_does_not_modify_logits():
    logits, temperature, top_k, top_p, min_p, noise, bitmask = make_case(4, 100, 5, True)
    before = logits.clone()
    sample_triton(logits, temperature, top_k, top_p, min_p, noise=noise, bitmask=bitmask)
    assert torch.equal(logits, before)


def test_in_kernel_noise_is_the_seeded_noise():
    logits, temperature, top_k, top_p, min_p, _, bitmask = make_case(8, 300, 6, True)
    seeds = torch.tensor([0, 1, 2, 3, 2**40, 7, 12345, 99], dtype=torch.long)
    noise = seeded_exponential_noise(seeds, 300)
    expected = sample_ref(logits, temperature, top_k, top_p, min_p, noise, bitmask)
    actual = sample_triton(logits, temperature, top_k, top_p, min_p, seeds=seeds, bitmask=bitmask)
    assert actual.tolist() == expected.tolist()
    assert torch.equal(noise, seeded_exponential_noise(seeds, 300))  # a seed reproduces its draw


def test_seeded_noise_is_exponential():
    noise = seeded_exponential_noise(torch.arange(4), 5000)
    assert bool((noise > 0).all())
    assert abs(noise.mean().item() - 1.0) < 0.03 and abs(noise.var().item() - 1.0) < 0.1
    assert not torch.equal(noise[0], noise[1])


def test_argument_errors():
    logits = torch.zeros(2, 10)
    params = (torch.ones(2), torch.full((2,), 10), torch.ones(2), torch.zeros(2))
    with pytest.raises(ValueError, match="exactly one"):
        sample_triton(logits, *params)
    with pytest.raises(ValueError, match="noise"):
        sample_triton(logits, *params, noise=torch.ones(2, 9))


# CUDA, full sizes --------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "batch,vocab", [(1, 49152), (64, 49152), (256, 128256), (16, 151936), (8, 32001)]
)
@pytest.mark.parametrize("constrained", [False, True])
def test_gpu_kernel_matches_reference(batch, vocab, constrained):
    check(batch, vocab, seed=batch, constrained=constrained, device="cuda")
