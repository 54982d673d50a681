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

from plait.runtime.sampling import Sampler, SamplingRow, apply_penalties, choose_sampler


def target_probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """`Sampler.target_probs` by the sampler chosen for these logits (per call: an engine passes
    its own to `verify_draft`)."""
    return choose_sampler(logits.device, logits.dtype).target_probs(logits, row)


def verify_draft(
    logits: torch.Tensor,
    draft: list[int],
    row_for: Callable[[int], SamplingRow],
    mask_row: Callable[[int, torch.Tensor], None],
    draft_probs: torch.Tensor | None = None,
    sampler: Sampler | None = None,
) -> list[int]:
    """logits [len(draft) + 1, V] float32 (rows are modified): row i scores the token after the
    context plus draft[:i]. `row_for(i)` gives row i's sampling state (its output so far includes
    draft[:i]); `mask_row(i, logits_i)` applies the grammar mask for that position (drafts were
    cut to what the grammar allows before verification). Returns the accepted draft prefix plus
    one target token. `sampler`: the engine's (None: chosen for the logits).
    """
    sampler = sampler or choose_sampler(logits.device, logits.dtype)
    out: list[int] = []
    for i in range(len(draft) + 1):
        row = row_for(i)
        mask_row(i, logits[i])
        if row.params.is_greedy:
            apply_penalties(logits[i][None], [row])
            choice = int(sampler.argmax(logits[i]))
            if i < len(draft) and choice == draft[i]:
                out.append(choice)
                continue
            out.append(choice)
            return out
        p = sampler.target_probs(logits[i], row)
        if i == len(draft):
            out.append(sampler.draw_one(p, row.generator))
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
        out.append(sampler.draw_one(residual, row.generator))
        return out
    raise AssertionError("unreachable: the last row always returns")
