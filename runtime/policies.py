"""The engine loop's per-step choices that depend on measurement, each with a deterministic mode.

- `ThreadPolicy`: the CPU threads a step runs on. `cpu_threads=None` (auto): every thread torch
  has, and the `ThreadGovernor` may run small steps on one where that measured faster (a busy
  machine); `cpu_threads=N`: exactly N threads for every step.
- `SpeculationPolicy`: whether a step's decodes draft. `auto`: the `SpeculationGovernor` decides
  per batch-size bucket by measuring drafts against bursts; `always` drafts every step (what
  tests of the drafts themselves want); `never` keeps the drafter loaded but never drafts.

How long a decode burst runs is `bursts.Bursts`.
"""

from __future__ import annotations

import torch

from plait.runtime.governor import ThreadGovernor
from plait.runtime.speculative.governor import SpeculationGovernor

SPECULATION_MODES = ("auto", "always", "never")


class ThreadPolicy:
    """Built on the caller's thread; `start`, `choose` and `release` run on the loop's thread, which
    the forwards run on (torch's intra-op thread count is a per-thread setting)."""

    def __init__(self, device: torch.device, cpu_threads: int | None) -> None:
        self._before = torch.get_num_threads()  # the process's count, given back by `release`
        self.threads = cpu_threads or self._before
        auto = device.type == "cpu" and cpu_threads is None and self.threads > 1
        # NOTE: on GPUs the CPU threads only feed kernel launches; nothing to tune there.
        self.governor = ThreadGovernor(self.threads) if auto else None
        self.current = self.threads  # the last step's threads, for `stats()`

    def start(self) -> None:
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def choose(self, num_tokens: int) -> int | None:
        """Sets this step's threads; returns them when governed (to `record`), else None."""
        if self.governor is None:
            return None
        threads = self.governor.choose(num_tokens)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self.current = threads
        return threads

    def record(self, num_tokens: int, threads: int | None, seconds: float) -> None:
        if threads is not None and self.governor is not None:
            self.governor.record(num_tokens, threads, seconds)

    def release(self) -> None:
        if torch.get_num_threads() != self._before:
            torch.set_num_threads(self._before)


class SpeculationPolicy:
    def __init__(self, mode: str) -> None:
        if mode not in SPECULATION_MODES:
            raise ValueError(
                f"speculation: expected one of {', '.join(SPECULATION_MODES)}, got {mode!r}"
            )
        self.mode = mode
        self.governor = SpeculationGovernor()

    def speculate(self, batch_size: int) -> bool:
        """Whether this step's `batch_size` decodes draft."""
        if self.mode == "auto":
            return self.governor.speculate(batch_size)
        return self.mode == "always"

    def record(
        self, batch_size: int, verified: bool, tokens: float, seconds: float, steps: int = 1
    ) -> None:
        """A pure decode step's outcome; the governor learns from it in every mode (its rates are
        in `stats()`), and decides only under `auto`."""
        self.governor.record(batch_size, verified, tokens, seconds, steps=steps)
