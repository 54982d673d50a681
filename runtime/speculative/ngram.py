"""N-gram drafting: continue the request's latest suffix the way it continued earlier in its own
prompt and output (prompt lookup decoding). No extra model, no tensors."""

from __future__ import annotations

from typing import Any

from plait.runtime.request import Request
from plait.runtime.speculative.base import Drafter


class NgramIndex:
    """Maps each n-gram of a token list to the position just after its latest occurrence."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.table: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the table
        self.ids: list[int] = []  # the request's tokens so far, kept by `sync`

    def sync(self, prompt: list[int], output: list[int]) -> list[int]:
        """`ids` brought up to prompt + output by appending only what is new since the last call
        (a step's cost stays with its new tokens, not the whole context)."""
        have, total = len(self.ids), len(prompt) + len(output)
        if have > total or (have and self._token(prompt, output, have - 1) != self.ids[-1]):
            self.table, self.indexed, self.ids = (
                {},
                0,
                [],
            )  # the tokens changed under us: start over
            have = 0
        if have < len(prompt):
            self.ids.extend(prompt[have:])
            self.ids.extend(output)
        else:
            self.ids.extend(output[have - len(prompt) :])
        return self.ids

    @staticmethod
    def _token(prompt: list[int], output: list[int], i: int) -> int:
        return prompt[i] if i < len(prompt) else output[i - len(prompt)]

    def update(self, ids: list[int], upto: int) -> None:
        for end in range(max(self.indexed, 1), upto + 1):
            for n in range(1, min(self.max_n, end) + 1):
                self.table[tuple(ids[end - n : end])] = end
        self.indexed = max(self.indexed, upto + 1)

    def lookup(self, ids: list[int], num_tokens: int, min_n: int) -> list[int]:
        # index every n-gram except the current suffix itself, which has no continuation yet
        self.update(ids, len(ids) - 1)
        for n in range(min(self.max_n, len(ids)), min_n - 1, -1):
            pos = self.table.get(tuple(ids[len(ids) - n :]))
            if pos is not None and pos < len(ids):
                return ids[pos : pos + num_tokens]
        return []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, **_: Any) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, reqs: list[Request], num_tokens: int) -> list[list[int]]:
        drafts = []
        for req in reqs:
            if req.spec.index is None:
                req.spec.index = NgramIndex(self.max_ngram)
            # propose about as far as recent drafts were accepted, plus a little more
            k = min(num_tokens, int(req.spec.mean_accepted) + 2)
            ids = req.spec.index.sync(req.prompt_ids, req.output_ids)
            drafts.append(req.spec.index.lookup(ids, k, self.min_ngram))
        return drafts
