"""From logits to next tokens: penalties, temperature, top-k / top-p / min-p, seeded draws.

Works on a batch of rows, one per request, each with its own `SamplingParams`. A `Sampler` holds
how sampled rows are drawn (Triton, the native CPU sampler or torch) and the greedy pick, both
chosen once for a device by `choose_sampler`: an engine's is chosen at start
(`runtime/execution.py`); `sample` chooses one per call for callers outside an engine.
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


@dataclass(frozen=True)
class SampledRows:
    """The rows of a batch that sample (not greedy): their indices in the batch (as a list and
    as `idx`, long [S] on the logits' device), their generators and their filter parameters
    (`filter_params`)."""

    rows: list[int]
    generators: list[torch.Generator | None]
    idx: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor


class Sampler:
    """Next tokens from logits on one device. `sample` applies the penalties and bans, takes the
    greedy pick (`argmax`, chosen for the device at construction) for every row, and hands the
    sampled rows to `draw`, which each subclass implements one way. A sampled row with no finite
    distribution (NaN or +inf logits, or every logit -inf) keeps its argmax on every path."""

    name: str  # as `Execution.describe` reports it: "triton", "native" or "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.argmax = choose_argmax(device)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """logits [B, V] float32 (modified in place) -> next token ids [B] long."""
        apply_penalties(logits, rows)
        out = self.argmax(logits)
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not sampled:
            return out
        idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        params = filter_params([rows[i].params for i in sampled], logits.shape[1], logits.device)
        generators = [rows[i].generator for i in sampled]
        return self.draw(logits, SampledRows(sampled, generators, idx, *params), out)

    def draw(self, logits: torch.Tensor, sampled: SampledRows, out: torch.Tensor) -> torch.Tensor:
        """`out` (the argmax of every row) with the sampled rows' draws in place of theirs."""
        raise NotImplementedError

    # one row at a time, for speculative verification (`runtime/speculative/verify.py`) ---------

    def target_probs(self, logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
        """The distribution `sample` draws from for this row: logits [V] (modified) -> probs
        [V]; the argmax alone where the row has no finite distribution (as `sample` takes it)."""
        apply_penalties(logits[None], [row])
        probs = self.filtered_probs(logits, row.params)
        if probs is None:
            probs = torch.zeros_like(logits)
            probs[self.argmax(logits)] = 1.0
        return probs

    def filtered_probs(self, logits: torch.Tensor, p: SamplingParams) -> torch.Tensor | None:
        """Temperature, top-k, top-p and min-p over logits [V] (penalties applied): probs [V], or
        None without a finite distribution. torch's softmax and `filter_probs`."""
        vocab, device = logits.shape[-1], logits.device
        probs = torch.softmax(logits / p.temperature, dim=-1)[None]
        top_k = torch.tensor([vocab if p.top_k < 0 else min(p.top_k, vocab)], device=device)
        top_p = torch.tensor([p.top_p], device=device)
        min_p = torch.tensor([p.min_p], device=device)
        probs = filter_probs(probs, top_k, top_p, min_p)[0]
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
            return None
        return probs

    def draw_one(self, probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token from probs [V]: `torch.multinomial` from the generator."""
        return int(torch.multinomial(probs, 1, generator=generator)[0])


class TorchSampler(Sampler):
    """torch's softmax and `filter_probs`, then `torch.multinomial` from each row's generator."""

    name = "torch"

    def draw(self, logits: torch.Tensor, sampled: SampledRows, out: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits[sampled.idx] / sampled.temperature[:, None], dim=-1)
        probs = filter_probs(probs, sampled.top_k, sampled.top_p, sampled.min_p)
        # NOTE: extreme but valid settings (a repetition penalty near 0, every token banned) can
        # leave a row with no finite distribution; such a row takes the argmax instead of failing.
        usable = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
        picks = self.pick(probs, sampled, usable)
        for j, i in enumerate(sampled.rows):
            if usable[j]:
                out[i] = picks[j]
        return out

    def pick(self, probs: torch.Tensor, sampled: SampledRows, usable: list[bool]) -> list:
        """One token per usable row of probs [S, V] (an unusable row's entry is never read)."""
        return [
            torch.multinomial(probs[j], 1, generator=g)[0] if usable[j] else None
            for j, g in enumerate(sampled.generators)
        ]


class TorchCpuSampler(TorchSampler):
    """On the CPU, without the native sampler: the same draw in torch, one uniform from each row's
    generator picking by inverse CDF (`sampling_cpu.draw_ref`), so a seed gives the tokens the
    native sampler gives."""

    def pick(self, probs: torch.Tensor, sampled: SampledRows, usable: list[bool]) -> list:
        return sampling_cpu.draw_ref(torch.nan_to_num(probs), _uniforms(sampled)).tolist()

    def draw_one(self, probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """By inverse CDF with one uniform from the generator, as `sample` draws."""
        return _draw_cpu(probs, generator)


class NativeSampler(Sampler):
    """float32 logits on the CPU: the native sampler (`sampling_cpu.sample_rows`), one uniform
    from each row's generator picking by inverse CDF."""

    name = "native"

    def draw(self, logits: torch.Tensor, sampled: SampledRows, out: torch.Tensor) -> torch.Tensor:
        uniforms = _uniforms(sampled)
        picks = sampling_cpu.sample_rows(
            logits[sampled.idx],
            sampled.temperature,
            sampled.top_k,
            sampled.top_p,
            sampled.min_p,
            uniforms,
        )
        for j, i in enumerate(sampled.rows):
            if picks[j] >= 0:  # else no finite distribution: the argmax stays
                out[i] = picks[j]
        return out

    def filtered_probs(self, logits: torch.Tensor, p: SamplingParams) -> torch.Tensor | None:
        """The native filter (`sampling_cpu.filtered_probs`): torch's sorts the whole vocabulary
        for top-k / top-p."""
        return sampling_cpu.filtered_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)

    def draw_one(self, probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """By inverse CDF with one uniform from the generator, as `sample` draws."""
        return _draw_cpu(probs, generator)


class TritonSampler(Sampler):
    """CUDA with Triton: one `sample_triton` kernel filters and draws every sampled row, seeded
    from each row's generator on the device (no host sync)."""

    name = "triton"

    def draw(self, logits: torch.Tensor, sampled: SampledRows, out: torch.Tensor) -> torch.Tensor:
        seeds = torch.cat(
            [
                torch.randint(0, 1 << 62, (1,), generator=g, device=logits.device)
                for g in sampled.generators
            ]
        )
        rows_logits = logits[sampled.idx].contiguous()
        picks = sample_triton(
            rows_logits,
            sampled.temperature,
            sampled.top_k,
            sampled.top_p,
            sampled.min_p,
            seeds=seeds,
        )
        bad = torch.isnan(rows_logits) | (rows_logits == float("inf"))
        usable = torch.isfinite(rows_logits).any(dim=-1) & ~bad.any(dim=-1)
        out[sampled.idx] = torch.where(usable, picks, out[sampled.idx])
        return out


def choose_sampler(device: torch.device, dtype: torch.dtype = torch.float32) -> Sampler:
    """The sampler for logits of `dtype` on `device`: Triton's on CUDA with Triton, the native one
    for float32 on the CPU where it built, torch's otherwise (its inverse-CDF draw on the CPU)."""
    probe = torch.empty(0, dtype=dtype, device=device)
    if use_triton(probe):
        return TritonSampler(probe.device)
    if probe.device.type != "cpu":
        return TorchSampler(probe.device)
    if dtype == torch.float32 and sampling_cpu.available():
        return NativeSampler(probe.device)
    return TorchCpuSampler(probe.device)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits [B, V] (modified in place) -> next token ids [B] long, by the sampler chosen for
    these logits (`choose_sampler`, per call: an engine holds its own)."""
    return choose_sampler(logits.device, logits.dtype).sample(logits, rows)


def _draw_cpu(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(sampling_cpu.draw_ref(probs[None], torch.rand(1, generator=generator))[0])


def _uniforms(sampled: SampledRows) -> torch.Tensor:
    """One uniform from each sampled row's generator, in row order: float32 [S]."""
    return torch.cat([torch.rand(1, generator=g) for g in sampled.generators])
