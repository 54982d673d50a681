"""Grammar masks inside a decode burst.

A burst (`BurstRunner.run`) runs many decode steps in one native call. For constrained
rows the kernel calls back before each step (`kernels/decode_stack.py: BurstMasks`), and
`GrammarBurst.before_step` advances a copy of each row's grammar with the token the row picked at
the previous step, fills its mask for the step, and says when the burst should end early:

- a row's grammar forces text ahead (`try_jump_forward`): the burst ends so that jump-forward
  appends it in one extend, as after a single step;
- every row has finished: picked a stop token, or its grammar is terminated (nothing but EOS may
  follow, which the output processor treats as a stop).

The copies are the callback's own: the output processor advances the request's grammar with the
burst's tokens afterwards, as it does after any step, so a burst changes nothing a step would
not. The callback runs on the engine thread (the one that made the native call), between steps.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from plait.kernels.constraint_mask import allocate_token_bitmask
from plait.runtime.constrained.base import Grammar, fill_bitmasks


class GrammarBurst:
    """The masks of one burst, written into `bitmask` and `masked` (`BurstMasks`' fields)."""

    forced_text_min_chars = 1

    def __init__(
        self,
        grammars: Sequence[Grammar | None],
        stop_ids: Sequence[Collection[int]],
        out: torch.Tensor,
        vocab_size: int,
        end_at_forced_text: bool = True,
    ) -> None:
        rows = len(grammars)
        self._grammars = [g.copy() if g is not None else None for g in grammars]
        self._stop_ids = [frozenset(s) for s in stop_ids]
        self._out = out.numpy()  # [rows, steps], written by the kernel
        self._finished = [False] * rows
        self._end_at_forced_text = end_at_forced_text
        self.bitmask = allocate_token_bitmask(rows, vocab_size)  # int32 [rows, words]
        self.masked = torch.zeros(rows, dtype=torch.int32)  # [rows]
        self._masked = self.masked.numpy()

    def before_step(self, step: int) -> bool:
        """Fills the masks of step `step`; True ends the burst before it."""
        following: list[Grammar | None] = [None] * len(self._grammars)
        forced = False
        for r, grammar in enumerate(self._grammars):
            if self._finished[r]:
                continue
            if step > 0:
                token = int(self._out[r, step - 1])
                if token in self._stop_ids[r]:
                    self._finished[r] = True
                    continue
                if grammar is None:
                    continue
                if not grammar.try_advance(token) or grammar.is_terminated():
                    self._finished[r] = True  # the output processor finishes (or fails) it
                    continue
                if self._end_at_forced_text:
                    text = grammar.try_jump_forward()
                    forced = forced or (
                        text is not None and len(text) >= self.forced_text_min_chars
                    )
            following[r] = grammar
        if step > 0 and (forced or all(self._finished)):
            return True
        self._masked[:] = 0
        for r in fill_bitmasks(following, self.bitmask):
            self._masked[r] = 1
        return False
