"""Bounds on runaway output under a JSON constraint: a number literal that never ends
(`1112222222...`) and whitespace that never ends, the two ways a small model spends its whole
budget inside a schema.

After the grammar fills a row, `apply` clears the tokens that would only lengthen the current
run (all-digit tokens past `max_digit_run` digits in a row, all-whitespace tokens past
`max_whitespace_run`) when the row still allows something else. It only ever removes tokens, so
every output stays inside the grammar; where only digits can follow (a pattern that asks for 40
digits), nothing is removed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_DIGITS = frozenset(b"0123456789")
_SPACE = frozenset(b" \t\n\r")


class RunawayBounds:
    def __init__(
        self, token_bytes: Sequence[bytes], max_digit_run: int, max_whitespace_run: int
    ) -> None:
        if max_digit_run < 0 or max_whitespace_run < 0:
            raise ValueError(
                f"bounds: max_digit_run={max_digit_run}, max_whitespace_run={max_whitespace_run}; "
                f"both must be >= 0 (0 is off)"
            )
        self.token_bytes = token_bytes
        self.max_digit_run = max_digit_run
        self.max_whitespace_run = max_whitespace_run
        # words with the bits of every token that is only digits / only whitespace cleared
        self.keep_non_digits = _keep_mask(token_bytes, _DIGITS)
        self.keep_non_space = _keep_mask(token_bytes, _SPACE)

    @property
    def enabled(self) -> bool:
        return bool(self.max_digit_run or self.max_whitespace_run)

    def apply(self, row: np.ndarray, tokens: Sequence[int]) -> None:
        """Narrows `row` (int32 words of one request) given the tokens output so far."""
        if not self.enabled or not tokens:
            return
        longest = max(self.max_digit_run, self.max_whitespace_run)
        tail = bytearray()
        for token_id in reversed(tokens):
            tail[:0] = self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""
            if len(tail) > longest:
                break
        for limit, charset, keep in (
            (self.max_digit_run, _DIGITS, self.keep_non_digits),
            (self.max_whitespace_run, _SPACE, self.keep_non_space),
        ):
            if limit and _run_length(tail, charset) >= limit:
                narrowed = row & keep[: len(row)]
                if narrowed.any():
                    row[:] = narrowed


def _run_length(tail: bytearray, charset: frozenset[int]) -> int:
    n = 0
    for byte in reversed(tail):
        if byte not in charset:
            break
        n += 1
    return n


def _keep_mask(token_bytes: Sequence[bytes], charset: frozenset[int]) -> np.ndarray:
    words = np.full((len(token_bytes) + 31) // 32, -1, dtype=np.int32)
    view = words.view(np.uint32)
    for token_id, spelled in enumerate(token_bytes):
        if spelled and all(b in charset for b in spelled):
            view[token_id // 32] &= ~np.uint32(1 << (token_id % 32))
    return words
