"""Verifying a draft against the target: the longest accepted run plus one token from the target.

Greedy rows accept a draft token when it is the target's argmax, so output equals non-speculative
decoding. Sampled rows use rejection sampling (Leviathan et al., 2023): accept draft token d with
probability min(1, p(d) / q(d)), else sample from max(p - q, 0) renormalized; a deterministic
draft has q = one-hot(d). Either way the accepted tokens follow the target distribution p, where p
is the row's filtered distribution (penalties, grammar mask, temperature, top-k / top-p / min-p).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.kernels import sampling_cpu
from plait.runtime.sampling import SamplingRow, apply_penalties, argmax, filter_probs


def target_probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The distribution `sample` draws from for this row: logits [V] (modified) -> probs [V]; the
    argmax alone where the row has no finite distribution (as `sample` takes it)."""
    p = row.params
    vocab = logits.shape[-1]
    apply_penalties(logits[None], [row])
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and sampling_cpu.available():
        # NOTE: native: torch's path sorts the whole vocabulary for top-k / top-p, per row
        probs = sampling_cpu.filtered_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
    else:
        probs = torch.softmax(logits / p.temperature, dim=-1)[None]
        top_k = torch.tensor([vocab if p.top_k < 0 else min(p.top_k, vocab)], device=logits.device)
        top_p, min_p = (
            torch.tensor([p.top_p], device=logits.device),
            torch.tensor([p.min_p], device=logits.device),
        )
        probs = filter_probs(probs, top_k, top_p, min_p)[0]
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
            probs = None
    if probs is None:
        probs = torch.zeros_like(logits)
        probs[argmax(logits)] = 1.0
    return probs


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V]: on the CPU by inverse CDF with one uniform from the generator
    (`sample`'s draw), elsewhere by `torch.multinomial`."""
    if probs.device.type == "cpu":
        return int(sampling_cpu.draw_ref(probs[None], torch.rand(1, generator=generator))[0])
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def verify_draft(
    logits: torch.Tensor,
    draft: list[int],
    row_for: Callable[[int], SamplingRow],
    mask_row: Callable[[int, torch.Tensor], None],
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """logits [len(draft) + 1, V] float32 (rows are modified): row i scores the token after the
    context plus draft[:i]. `row_for(i)` gives row i's sampling state (its output so far includes
    draft[:i]); `mask_row(i, logits_i)` applies the grammar mask for that position (drafts were
    cut to what the grammar allows before verification). Returns the accepted draft prefix plus
    one target token.
    """
    out: list[int] = []
    for i in range(len(draft) + 1):
        row = row_for(i)
        mask_row(i, logits[i])
        if row.params.is_greedy:
            apply_penalties(logits[i][None], [row])
            choice = int(argmax(logits[i]))
            if i < len(draft) and choice == draft[i]:
                out.append(choice)
                continue
            out.append(choice)
            return out
        p = target_probs(logits[i], row)
        if i == len(draft):
            out.append(_draw(p, row.generator))
            return out
        d = draft[i]
        q = draft_probs[i] if draft_probs is not None else None
        q_d = 1.0 if q is None else float(q[d])
        u = torch.rand((), generator=row.generator).item()
        if q_d > 0 and u < min(1.0, float(p[d]) / q_d):
            out.append(d)
            continue
        residual = p.clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        residual = p if total <= 0 else residual / total
        out.append(_draw(residual, row.generator))
        return out
    raise AssertionError("unreachable: the last row always returns")
