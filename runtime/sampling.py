"""From logits to next tokens: penalties, temperature, top-k / top-p / min-p, seeded draws.

Works on a batch of rows, one per request, each with its own `SamplingParams`. How sampled rows
are drawn (`sampling_path`: Triton, the native CPU sampler or torch) is chosen once per engine
(`runtime/execution.py`) and passed to `sample`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from plait.kernels import sampling_cpu
from plait.kernels.dispatch import use_triton
from plait.kernels.sampling_triton import filter_probs_ref as filter_probs
from plait.kernels.sampling_triton import sample_triton
from plait.runtime.protocol import SamplingParams


@dataclass
class SamplingRow:
    """What sampling needs to know about one request at this step (plain Python data)."""

    params: SamplingParams
    output_ids: Sequence[int]
    prompt_ids: Sequence[int]
    banned_ids: Sequence[int]  # EOS / stop tokens while min_new_tokens is not reached
    generator: torch.Generator | None


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place. frequency/presence count generated tokens (OpenAI); repetition counts all (HF)."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
            ids = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                list(set(row.prompt_ids) | set(row.output_ids)),
                dtype=torch.long,
                device=logits.device,
            )
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if row.banned_ids:
            logits[i, list(row.banned_ids)] = float("-inf")


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V].argmax(-1) (the first maximum, as torch's). On the CPU by numpy, whose
    argmax over a vocabulary's logits is several times faster than torch's (chosen per call:
    `choose_argmax` settles it once for a device)."""
    if logits.device.type == "cpu":
        return argmax_cpu(logits)
    return logits.argmax(dim=-1)


def argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    """`argmax` of CPU logits: numpy's for contiguous float32 ones, else torch's."""
    if logits.dtype == torch.float32 and logits.is_contiguous():
        return torch.from_numpy(np.asarray(logits.numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)


def choose_argmax(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """The greedy pick for logits on `device`."""
    return argmax_cpu if device.type == "cpu" else _torch_argmax


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def filter_params(
    params: Sequence[SamplingParams], vocab: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature (0 for greedy rows), top_k (`vocab` when off), top_p and min_p: float32
    [B], int64 [B], float32 [B], float32 [B]."""
    f32 = dict(dtype=torch.float32, device=device)
    return (
        torch.tensor([0.0 if p.is_greedy else p.temperature for p in params], **f32),
        torch.tensor(
            [vocab if p.top_k < 0 else min(p.top_k, vocab) for p in params],
            dtype=torch.long,
            device=device,
        ),
        torch.tensor([p.top_p for p in params], **f32),
        torch.tensor([p.min_p for p in params], **f32),
    )


def sampling_path(device: torch.device, dtype: torch.dtype) -> str:
    """How logits of `dtype` on `device` are sampled: "triton" on CUDA with Triton, "native" for
    float32 on the CPU where the native sampler built, "torch" otherwise."""
    probe = torch.empty(0, dtype=dtype, device=device)
    if use_triton(probe):
        return "triton"
    if probe.device.type == "cpu" and dtype == torch.float32 and sampling_cpu.available():
        return "native"
    return "torch"


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], path: str | None = None
) -> torch.Tensor:
    """logits [B, V] float32 (modified in place) -> next token ids [B] long; `path` (an engine's,
    chosen once; None: `sampling_path` of the logits) says how sampled rows are drawn.

    On the CPU each sampled row draws one uniform from its generator and picks by inverse CDF
    (`kernels/sampling_cpu.py`: "native", or the same draw in torch). With "triton", one kernel
    filters and draws every sampled row (`sample_triton`, seeded from each row's generator, no
    host sync); on other devices `torch.multinomial` draws."""
    apply_penalties(logits, rows)
    greedy = [r.params.is_greedy for r in rows]
    out = argmax(logits)
    sampled = [i for i, g in enumerate(greedy) if not g]
    if not sampled:
        return out
    idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
    temperature, top_k, top_p, min_p = filter_params(
        [rows[i].params for i in sampled], logits.shape[1], logits.device
    )
    path = path or sampling_path(logits.device, logits.dtype)
    if path == "triton":
        return _sample_triton(logits, rows, sampled, idx, out, (temperature, top_k, top_p, min_p))
    on_cpu = logits.device.type == "cpu"
    if on_cpu:
        uniforms = torch.cat([torch.rand(1, generator=rows[i].generator) for i in sampled])
        if path == "native":
            picks = sampling_cpu.sample_rows(
                logits[idx], temperature, top_k, top_p, min_p, uniforms
            )
            for j, i in enumerate(sampled):
                if picks[j] >= 0:  # else no finite distribution: the argmax stays
                    out[i] = picks[j]
            return out
    probs = torch.softmax(logits[idx] / temperature[:, None], dim=-1)
    probs = filter_probs(probs, top_k, top_p, min_p)
    # NOTE: extreme but valid settings (a repetition penalty near 0, every token banned) can
    # leave a row with no finite distribution; such a row takes the argmax instead of failing.
    usable = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
    picks = sampling_cpu.draw_ref(torch.nan_to_num(probs), uniforms).tolist() if on_cpu else None
    for j, i in enumerate(sampled):
        if usable[j]:
            out[i] = (
                picks[j]
                if on_cpu
                else torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
            )
    return out


def _sample_triton(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    sampled: list[int],
    idx: torch.Tensor,
    out: torch.Tensor,
    params: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """The sampled rows `idx` of `out` drawn by `sample_triton`: one seed per row from its generator
    (on the device: no host sync). A row with no finite distribution (NaN or +inf logits, or all
    -inf) keeps its argmax, as on the other paths."""
    seeds = torch.cat(
        [
            torch.randint(0, 1 << 62, (1,), generator=rows[i].generator, device=logits.device)
            for i in sampled
        ]
    )
    rows_logits = logits[idx].contiguous()
    picks = sample_triton(rows_logits, *params, seeds=seeds)
    bad = torch.isnan(rows_logits) | (rows_logits == float("inf"))
    usable = torch.isfinite(rows_logits).any(dim=-1) & ~bad.any(dim=-1)
    out[idx] = torch.where(usable, picks, out[idx])
    return out
