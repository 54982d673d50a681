"""Vocabulary bitmask kernels: the torch reference against a plain definition, the Triton kernel
(in Triton's CPU interpreter, and on CUDA when present) against the reference."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.constraint_mask import (
    allocate_token_bitmask,
    apply_token_bitmask,
    apply_token_bitmask_cpu,
    apply_token_bitmask_ref,
    apply_token_bitmask_triton,
    choose_bitmask_apply,
    num_bitmask_words,
)


def random_case(batch: int, vocab: int, num_words: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, num_words), dtype=torch.int32, generator=g)
    bitmask[0, : num_words // 2] = -1  # some all-allowed and all-blocked words too
    if batch > 1:
        bitmask[1, num_words // 2 :] = 0
    return logits, bitmask


def masked_by_definition(logits, bitmask, rows):
    out = logits.clone()
    for r in rows:
        for t in range(logits.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[r, word]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = float("-inf")
    return out


def test_allocate():
    mask = allocate_token_bitmask(3, 49153)
    assert mask.shape == (3, 1537) and mask.dtype == torch.int32
    assert bool((mask == -1).all())
    assert num_bitmask_words(32) == 1 and num_bitmask_words(33) == 2
    with pytest.raises(ValueError):
        allocate_token_bitmask(1, 0)


@pytest.mark.parametrize("vocab,num_words", [(1, 1), (31, 1), (32, 1), (33, 2), (70, 2), (100, 4)])
@pytest.mark.parametrize("rows", [None, [1], [0, 2], []])
def test_reference_matches_definition(vocab, num_words, rows):
    logits, bitmask = random_case(3, vocab, num_words, seed=vocab)
    expected = masked_by_definition(logits, bitmask, range(3) if rows is None else rows)
    apply_token_bitmask_ref(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_reference_accepts_index_tensor_and_leaves_free_rows():
    logits, bitmask = random_case(4, 100, 4, seed=1)
    original = logits.clone()
    apply_token_bitmask_ref(logits, bitmask, torch.tensor([3, 1]))
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    assert torch.isinf(logits[1]).any() and torch.isinf(logits[3]).any()


def test_shape_errors():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_ref(logits, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_ref(logits, torch.zeros(2, 2, dtype=torch.int64))


TRITON_GRID = [
    # (batch, vocab, words): vocab not a multiple of 32, and wider than the mask (model vocab >
    # tokenizer vocab: the extra ids must end up blocked)
    (1, 1, 1),
    (3, 100, 4),
    (2, 1000, 32),
    (4, 2049, 64),
    (2, 49152, 1536),
    (3, 49160, 1536),
    (2, 5000, 200),
]


@pytest.fixture
def triton_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("batch,vocab,num_words", TRITON_GRID)
@pytest.mark.parametrize("rows", ["all", "some", "none"])
def test_triton_interpreted_matches_reference(triton_interpreter, batch, vocab, num_words, rows):
    logits, bitmask = random_case(batch, vocab, num_words, seed=vocab + batch)
    indices = {"all": None, "some": list(range(0, batch, 2)), "none": []}[rows]
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, indices)
    apply_token_bitmask_triton(logits, bitmask, indices)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_interpreted_half_precision(triton_interpreter, dtype):
    logits, bitmask = random_case(2, 300, 10, seed=5, dtype=dtype)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, torch.tensor([1]))
    apply_token_bitmask_triton(logits, bitmask, torch.tensor([1]))
    assert torch.equal(logits, expected)


@pytest.mark.parametrize(
    "batch,vocab,num_words,dtype",
    [(*case, torch.float32) for case in TRITON_GRID]
    + [(3, 100, 4, torch.float16), (2, 5000, 200, torch.float16), (3, 100, 4, torch.bfloat16)],
)
def test_cpu_path_matches_reference(batch, vocab, num_words, dtype):
    logits, bitmask = random_case(batch, vocab, num_words, seed=vocab, dtype=dtype)
    for indices in (None, list(range(batch - 1, -1, -2)), torch.tensor([0]), []):
        expected, actual = logits.clone(), logits.clone()
        apply_token_bitmask_ref(expected, bitmask, indices)
        apply_token_bitmask_cpu(actual, bitmask, indices)
        assert torch.equal(actual, expected)


def test_dispatch_on_cpu_is_the_reference():
    logits, bitmask = random_case(3, 500, 16, seed=2)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, [0, 2])
    apply_token_bitmask(logits, bitmask, [0, 2])
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("disabled", [False, True])
def test_the_kernel_chosen_once_for_the_cpu_is_the_reference(monkeypatch, disabled):
    """`choose_bitmask_apply`: the native rows where the library built, numpy where it is off;
    both mask as the reference does."""
    from plait.kernels import native

    monkeypatch.setattr(native, "DISABLED", disabled)
    apply = choose_bitmask_apply(torch.device("cpu"))
    logits, bitmask = random_case(4, 3000, 94, seed=5)
    for indices in (None, [3, 1], []):
        expected, actual = logits.clone(), logits.clone()
        apply_token_bitmask_ref(expected, bitmask, indices)
        apply(actual, bitmask, indices)
        assert torch.equal(actual, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "batch,vocab,num_words", TRITON_GRID + [(64, 151936, 4748), (256, 128256, 4008)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_cuda_matches_reference(batch, vocab, num_words, dtype):
    pytest.importorskip("triton")
    logits, bitmask = random_case(batch, vocab, num_words, seed=vocab, dtype=dtype)
    logits, bitmask = logits.cuda(), bitmask.cuda()
    indices = torch.arange(0, batch, 3, device="cuda")
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, indices)
    apply_token_bitmask(logits, bitmask, indices)  # dispatches to Triton on CUDA
    assert torch.equal(logits, expected)
    everything = logits.clone()
    apply_token_bitmask_ref(expected, bitmask)
    apply_token_bitmask_triton(everything, bitmask)
    assert torch.equal(everything, expected)
