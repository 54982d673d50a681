"""Sampling on the CPU in native code (`csrc/cpu_sampling.cpp`): temperature, min-p, top-k, top-p
and the draw, one token per row, with the kept set of `sampling_triton.filter_probs_ref`.

The draw is by inverse CDF: with the kept probabilities p in vocabulary order and a uniform u in
[0, 1) that the caller takes from the request's generator, the token is the first index whose
running sum of p exceeds u * sum(p). `draw_ref` is the same draw in torch, which
`runtime/sampling.py` takes where the native kernels are unavailable: given the same u, both pick
the same token (up to float rounding at the edge between two tokens).

torch's own path sorts the whole vocabulary for top-k / top-p and draws with `torch.multinomial`;
the kernel sorts only the few candidates near the boundary and draws in one pass, which makes the
filter and the draw a small part of a step.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from plait.kernels import native


@cache
def _fn():
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return native.function(
        "cpu_kernels", "plait_sample_rows", [p, i64, i64, p, p, p, p, p, p, ctypes.c_int]
    )


@cache
def _probs_fn():
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    return native.function(
        "cpu_kernels", "plait_filtered_probs_row", [p, i64, f32, i64, f32, f32, p], restype=i64
    )


def available() -> bool:
    """The native sampler is built and not disabled (`PLAIT_DISABLE_NATIVE`)."""
    return not native.native_disabled() and _fn() is not None


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Tokens [B] long drawn from logits [B, V] float32 on the CPU (not modified), per row with
    temperature (> 0), top_k (>= V: off), top_p, min_p and a uniform in [0, 1). -1 marks a row with
    no finite distribution (NaN logits, or every logit -inf)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError(
            f"logits: float32 [rows, vocab] on the CPU, got {logits.dtype} {tuple(logits.shape)}"
        )
    rows, vocab = logits.shape
    logits = logits.contiguous()
    t = temperature.to(torch.float32).contiguous()
    k = top_k.to(torch.long).clamp(max=vocab).contiguous()
    tp = top_p.to(torch.float32).contiguous()
    mp = min_p.to(torch.float32).contiguous()
    u = uniforms.to(torch.float32).contiguous()
    for name, value in (
        ("temperature", t),
        ("top_k", k),
        ("top_p", tp),
        ("min_p", mp),
        ("uniforms", u),
    ):
        if value.shape != (rows,):
            raise ValueError(f"{name}: one value per row ({rows}), got shape {tuple(value.shape)}")
    if rows and not bool((t > 0).all()):
        raise ValueError(
            "temperature: must be > 0 for every sampled row (0 means greedy: take the argmax)"
        )
    out = torch.empty(rows, dtype=torch.long)
    _fn()(
        logits.data_ptr(),
        rows,
        vocab,
        t.data_ptr(),
        k.data_ptr(),
        tp.data_ptr(),
        mp.data_ptr(),
        u.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor | None:
    """The distribution `sample_rows` draws from, normalized: logits [V] float32 on the CPU (not
    modified) -> probs [V], zero outside the kept tokens; None when the row has no finite
    distribution. The same kept set as `filter_probs_ref`, without sorting the vocabulary."""
    if logits.dim() != 1 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError(
            f"logits: float32 [vocab] on the CPU, got {logits.dtype} {tuple(logits.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    logits = logits.contiguous()
    vocab = logits.shape[0]
    out = torch.empty(vocab, dtype=torch.float32)
    k = vocab if top_k < 0 else min(top_k, vocab)
    ok = _probs_fn()(logits.data_ptr(), vocab, temperature, k, top_p, min_p, out.data_ptr())
    return out if ok == 0 else None


def draw_ref(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw in torch: per row of probs [B, V] (non-negative, any scale), the first
    index whose running sum exceeds u * the row's sum, for uniforms [B] in [0, 1)."""
    cum = probs.double().cumsum(dim=-1)
    x = uniforms.to(cum)[:, None] * cum[:, -1:]
    picks = (cum <= x).sum(dim=-1)
    # rounding can leave the sum short of x: take the last token with any probability
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.where(picks < probs.shape[-1], picks, last)
