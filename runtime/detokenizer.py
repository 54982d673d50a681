"""Streaming ids -> text without ever emitting half a UTF-8 character.

The vLLM approach over ids: decode a small window of recent ids, emit what it adds beyond the
text already emitted, and hold back a tail that ends in U+FFFD (an incomplete UTF-8 sequence) until
a later id completes it. The window restarts whenever it ends on a whole character, so each `add`
costs O(window), not O(output length).

For byte-level BPE the pieces concatenate to exactly `tokenizer.decode(output_ids)`. Known
differences:
- Sentencepiece with `prompt_ids`: the first piece keeps the leading space of its first token,
  which `decode(output_ids)` alone strips; that is what makes `prompt_text + text` right.
- More than `MAX_PENDING_TOKENS` ids in a row that each end inside a UTF-8 sequence (invalid or
  adversarial byte streams; never valid text) force the held-back U+FFFD out, so how many U+FFFD
  an invalid run becomes can differ from a one-shot decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from plait.runtime.tuning import MAX_PENDING_TOKENS, PROMPT_CONTEXT_TOKENS

if TYPE_CHECKING:
    from plait.runtime.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text; `add` returns the newly stable text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.num_tokens = 0
        self._pieces: list[str] = []
        context = list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        if self._decode(context).endswith(REPLACEMENT):
            context = []
        # `_window` = context ids (before `_read`) + ids whose text is not yet all emitted.
        self._window: list[int] = []
        self._read = 0
        self._emitted = 0
        self._restart(context)

    def add(self, new_ids: Sequence[int]) -> str:
        if not new_ids:
            return ""
        self.num_tokens += len(new_ids)
        self._window.extend(new_ids)
        text = self._decode(self._window)
        stable = text.rstrip(REPLACEMENT)
        complete = len(stable) == len(text)
        forced = not complete and len(self._window) - self._read > MAX_PENDING_TOKENS
        piece = (text if forced else stable)[self._emitted :]
        self._emitted = max(self._emitted, len(stable))
        if forced:
            self._restart([])
        elif complete:
            self._restart(self._window[self._read :])
        return self._append(piece)

    def flush(self) -> str:
        """Everything still held back; an incomplete UTF-8 tail becomes U+FFFD as `decode` does."""
        piece = self._decode(self._window)[self._emitted :]
        self._restart([])
        return self._append(piece)

    @property
    def has_pending(self) -> bool:
        """True while some added ids' text is held back (an incomplete character)."""
        return len(self._window) > self._read

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _append(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece

    def _restart(self, context: list[int]) -> None:
        self._window = context
        self._read = len(context)
        self._emitted = len(self._decode(context))

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
