"""Constrained sampling in one kernel: vocabulary bitmask, temperature, min-p / top-k / top-p
filtering and the draw, one program per row, with no host sync (torch reference beside it).

Semantics (the reference, `filter_probs_ref`, is plait's `runtime/sampling.py` `filter_probs`):
- masked logits: -inf where the row's bitmask bit is 0 (`constraint_mask` layout; rows that are not
  constrained should hold -1 words, as `allocate_token_bitmask` makes them);
- temperature 0 = greedy: the first index of the largest masked logit;
- otherwise probs = softmax(logits / temperature); min-p zeroes probs below `min_p * max(probs)`;
  then, in descending order, a token is kept when its rank is below top_k and the mass strictly
  before it is below `top_p` times the remaining mass (the most likely token is always kept);
- the draw is an exponential race: the kept token maximizing `prob / noise`, noise ~ Exp(1), which
  picks token t with probability prob[t] / sum(kept). Given the same noise tensor, reference and
  kernel pick the same token, which makes them comparable deterministically.

The kernel finds the kept set without sorting: the kept tokens are exactly those with
`prob >= cutoff`, and the smallest such cutoff is found by a search over float32 bit patterns
(monotone for non-negative floats), testing NUM_PIVOTS candidates per pass over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.kernels.constraint_mask import apply_token_bitmask_ref
from plait.kernels.dispatch import launch
from plait.kernels.tuning import SAMPLE_BLOCK_V, SAMPLE_NUM_PIVOTS

try:
    import triton
    import triton.language as tl
except ImportError:  # Linux-only wheels; the torch reference needs nothing else
    triton = None


# torch reference -----------------------------------------------------------------------------


def filter_probs_ref(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zeroes probabilities outside each row's top-k / top-p / min-p support, then renormalizes.

    probs [B, V]; top_k [B] long (vocab size = off); top_p, min_p [B] float.
    `plait.runtime.sampling` samples with this very function on the CPU.
    """
    vocab = probs.shape[1]
    if bool((min_p > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        drop = ranks >= top_k[:, None]
        # a token is kept if the mass strictly before it is below top_p (the first is always kept)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, sorted_ids, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def sampling_probs_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distribution each row samples from, [B, V] float32 (one-hot at the argmax when
    greedy)."""
    logits = logits.float().clone()  # [B, V]
    if bitmask is not None:
        apply_token_bitmask_ref(logits, bitmask)
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature.float())[:, None]
    probs = filter_probs_ref(torch.softmax(scaled, dim=-1), top_k, top_p, min_p)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token ids [B] long; noise [B, V] holds Exp(1) draws (see `exponential_noise`)."""
    probs = sampling_probs_ref(logits, temperature, top_k, top_p, min_p, bitmask)
    return (probs / noise).argmax(dim=-1)


def exponential_noise(
    num_rows: int,
    vocab_size: int,
    generators: Sequence[torch.Generator | None],
    default: torch.Generator | None,
    device: torch.device | str,
) -> torch.Tensor:
    """[num_rows, vocab_size] float32 Exp(1) draws, row i from generators[i] (or `default`)."""
    noise = torch.empty(num_rows, vocab_size, device=device)
    if all(g is None for g in generators):
        noise.exponential_(generator=default)
    else:
        for i, g in enumerate(generators):
            noise[i].exponential_(generator=g if g is not None else default)
    # NOTE: a zero draw would make prob / noise infinite for any token with nonzero mass.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


# Triton kernel -------------------------------------------------------------------------------

_BLOCK_V = SAMPLE_BLOCK_V
_NUM_PIVOTS = SAMPLE_NUM_PIVOTS

if triton is not None:

    @triton.jit
    def _masked_logits(
        row_logits, row_bitmask, num_words, offs, vocab_size, HAS_BITMASK: tl.constexpr
    ):
        in_vocab = offs < vocab_size
        x = tl.load(row_logits + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        if HAS_BITMASK:
            words = offs // 32
            packed = tl.load(row_bitmask + words, mask=in_vocab & (words < num_words), other=0)
            x = tl.where(((packed >> (offs % 32)) & 1) != 0, x, float("-inf"))
        return x

    @triton.jit
    def _seeded_noise(seeds_ptr, row, offs):
        # Exp(1) draws from Philox; u == 0 gives +inf, which no token can win with
        seed = tl.load(seeds_ptr + row)
        return -tl.log(tl.rand(seed, offs))

    @triton.jit
    def _seeded_noise_kernel(seeds_ptr, out_ptr, out_stride, vocab_size, BLOCK_V: tl.constexpr):
        # grid: (rows, vocabulary blocks)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        noise = _seeded_noise(seeds_ptr, row, offs)
        tl.store(out_ptr + row * out_stride + offs, noise, mask=offs < vocab_size)

    @triton.jit
    def _sample_kernel(
        logits_ptr,
        logits_stride,
        bitmask_ptr,
        bitmask_stride,
        num_words,
        temperature_ptr,
        top_k_ptr,
        top_p_ptr,
        min_p_ptr,
        noise_ptr,
        noise_stride,
        seeds_ptr,
        out_ptr,
        probs_ptr,
        probs_stride,
        vocab_size,
        HAS_BITMASK: tl.constexpr,
        NOISE_FROM_SEEDS: tl.constexpr,
        STORE_PROBS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        NUM_PIVOTS: tl.constexpr,
    ):
        # grid: (rows,); each program walks its row's vocabulary in BLOCK_V chunks
        row = tl.program_id(0).to(tl.int64)
        row_logits = logits_ptr + row * logits_stride
        row_bitmask = bitmask_ptr + row * bitmask_stride
        temperature = tl.load(temperature_ptr + row).to(tl.float32)
        top_k = tl.load(top_k_ptr + row).to(tl.int32)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        greedy = temperature <= 0.0
        temperature = tl.where(greedy, 1.0, temperature)
        lanes = tl.arange(0, BLOCK_V)

        # max and first argmax of the masked logits
        best = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.full((), 0, tl.int32)
        for start in range(0, vocab_size, BLOCK_V):
            x = _masked_logits(
                row_logits, row_bitmask, num_words, start + lanes, vocab_size, HAS_BITMASK
            )
            block_best = tl.max(x, 0)
            take = block_best > best
            best_idx = tl.where(take, start + tl.argmax(x, 0), best_idx)
            best = tl.where(take, block_best, best)

        if greedy:
            tl.store(out_ptr + row, best_idx.to(tl.int64))
            if STORE_PROBS:
                for start in range(0, vocab_size, BLOCK_V):
                    offs = start + lanes
                    one_hot = tl.where(offs == best_idx, 1.0, 0.0)
                    tl.store(probs_ptr + row * probs_stride + offs, one_hot, mask=offs < vocab_size)
        else:
            # softmax normalizer; p = exp(x / T - m) / z, the largest p is 1 / z
            m = best / temperature
            z = tl.full((), 0.0, tl.float32)
            for start in range(0, vocab_size, BLOCK_V):
                x = _masked_logits(
                    row_logits, row_bitmask, num_words, start + lanes, vocab_size, HAS_BITMASK
                )
                z += tl.sum(tl.exp(x / temperature - m), 0)
            p_max = 1.0 / z
            threshold = min_p * p_max  # min-p: smaller probs are zeroed

            total = tl.full((), 0.0, tl.float32)  # mass left after min-p
            for start in range(0, vocab_size, BLOCK_V):
                x = _masked_logits(
                    row_logits, row_bitmask, num_words, start + lanes, vocab_size, HAS_BITMASK
                )
                p = tl.exp(x / temperature - m) / z
                total += tl.sum(tl.where(p >= threshold, p, 0.0), 0)

            # top-k / top-p: the smallest cutoff c such that a token of prob c would be kept
            # (fewer than k tokens above it, and their mass below top_p * total)
            top_k = tl.minimum(tl.maximum(top_k, 1), vocab_size)
            lo = tl.full((), 0, tl.int32)
            hi = tl.full((), 0, tl.int32)
            if (top_k < vocab_size) | (top_p < 1.0):
                hi = p_max.to(tl.int32, bitcast=True)
            mass_limit = tl.where(top_p < 1.0, top_p * total, float("inf"))
            pivots = tl.arange(0, NUM_PIVOTS) + 1  # [P], 1-based
            while lo < hi:
                step = (hi - lo + NUM_PIVOTS) // NUM_PIVOTS
                cand = tl.minimum(lo + pivots * step - 1, hi)  # [P] bit patterns, the last is hi
                cand_p = cand.to(tl.float32, bitcast=True)
                count = tl.zeros((NUM_PIVOTS,), tl.int32)
                mass = tl.zeros((NUM_PIVOTS,), tl.float32)
                for start in range(0, vocab_size, BLOCK_V):
                    x = _masked_logits(
                        row_logits, row_bitmask, num_words, start + lanes, vocab_size, HAS_BITMASK
                    )
                    p = tl.exp(x / temperature - m) / z
                    above = (p >= threshold)[:, None] & (
                        p[:, None] > cand_p[None, :]
                    )  # [BLOCK_V, P]
                    count += tl.sum(above.to(tl.int32), 0)
                    mass += tl.sum(tl.where(above, p[:, None], 0.0), 0)
                ok = (count < top_k) & (mass < mass_limit)
                ok = ok | (cand >= hi)  # hi is kept by the invariant (initially: the top token)
                first_ok = NUM_PIVOTS - tl.sum(ok.to(tl.int32), 0) + 1
                new_hi = tl.sum(tl.where(pivots == first_ok, cand, 0), 0)
                below = tl.sum(tl.where(pivots == first_ok - 1, cand, 0), 0) + 1
                lo = tl.where(first_ok == 1, lo, below)
                hi = new_hi
            cutoff = hi.to(tl.float32, bitcast=True)

            # exponential race over the kept tokens
            best_score = tl.full((), -1.0, tl.float32)
            token = best_idx
            kept_mass = tl.full((), 0.0, tl.float32)
            for start in range(0, vocab_size, BLOCK_V):
                offs = start + lanes
                x = _masked_logits(
                    row_logits, row_bitmask, num_words, offs, vocab_size, HAS_BITMASK
                )
                p = tl.exp(x / temperature - m) / z
                keep = (p >= threshold) & (p >= cutoff) & (offs < vocab_size)
                if NOISE_FROM_SEEDS:
                    noise = _seeded_noise(seeds_ptr, row, offs)
                else:
                    noise = tl.load(
                        noise_ptr + row * noise_stride + offs, mask=offs < vocab_size, other=1.0
                    )
                score = tl.where(keep, p / noise, -1.0)
                block_best = tl.max(score, 0)
                take = block_best > best_score
                token = tl.where(take, start + tl.argmax(score, 0), token)
                best_score = tl.where(take, block_best, best_score)
                kept_mass += tl.sum(tl.where(keep, p, 0.0), 0)
            tl.store(out_ptr + row, token.to(tl.int64))
            if STORE_PROBS:
                for start in range(0, vocab_size, BLOCK_V):
                    offs = start + lanes
                    x = _masked_logits(
                        row_logits, row_bitmask, num_words, offs, vocab_size, HAS_BITMASK
                    )
                    p = tl.exp(x / temperature - m) / z
                    keep = (p >= threshold) & (p >= cutoff)
                    tl.store(
                        probs_ptr + row * probs_stride + offs,
                        tl.where(keep, p / kept_mass, 0.0),
                        mask=offs < vocab_size,
                    )


def sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    noise: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    probs_out: torch.Tensor | None = None,
    block_v: int = _BLOCK_V,
    num_pivots: int = _NUM_PIVOTS,
) -> torch.Tensor:
    """Next token ids [B] long, on the logits' device; the same contract as `sample_ref`.

    The draw uses `noise` [B, V] (Exp(1), as the reference) or, without it, Exp(1) noise made in
    the kernel from `seeds` [B] int64 (Philox: `tl.rand(seed, token)`). `probs_out` [B, V] float32,
    when given, receives the filtered distribution (for tests; it costs one more pass).
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"sample_triton: logits must be [B, V] with contiguous rows, got {tuple(logits.shape)}"
        )
    if (noise is None) == (seeds is None):
        raise ValueError("sample_triton: pass exactly one of noise and seeds")
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    if num_rows == 0:
        return out
    if noise is not None and (noise.shape != logits.shape or noise.stride(1) != 1):
        raise ValueError(f"sample_triton: noise must be {tuple(logits.shape)} with contiguous rows")
    if bitmask is not None and (bitmask.dtype != torch.int32 or bitmask.shape[0] != num_rows):
        raise ValueError(f"sample_triton: bitmask must be int32 [{num_rows}, words]")
    params = [t.to(logits.device) for t in (temperature, top_k, top_p, min_p)]
    dummy = out
    launch(
        _sample_kernel,
        (num_rows,),
        logits,
        logits,
        logits.stride(0),
        bitmask if bitmask is not None else dummy,
        bitmask.stride(0) if bitmask is not None else 0,
        bitmask.shape[1] if bitmask is not None else 0,
        *params,
        noise if noise is not None else logits,
        noise.stride(0) if noise is not None else 0,
        seeds.to(logits.device) if seeds is not None else dummy,
        out,
        probs_out if probs_out is not None else logits,
        probs_out.stride(0) if probs_out is not None else 0,
        vocab_size,
        HAS_BITMASK=bitmask is not None,
        NOISE_FROM_SEEDS=noise is None,
        STORE_PROBS=probs_out is not None,
        BLOCK_V=block_v,
        NUM_PIVOTS=num_pivots,
        num_warps=8,
    )
    return out


def seeded_exponential_noise(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, vocab_size] float32: exactly the noise `sample_triton(..., seeds=seeds)` draws in-kernel,
    so `sample_ref(..., noise=seeded_exponential_noise(seeds, V))` picks the same tokens."""
    out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        grid = (seeds.shape[0], triton.cdiv(vocab_size, _BLOCK_V))
        launch(
            _seeded_noise_kernel,
            grid,
            seeds,
            seeds,
            out,
            out.stride(0),
            vocab_size,
            BLOCK_V=_BLOCK_V,
        )
    return out
