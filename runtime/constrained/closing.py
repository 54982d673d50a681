"""Budget-aware closing: the short way from a grammar state to an accepting one, so that a
constrained request about to run out of `max_new_tokens` ends in output that parses.

The search walks the grammar's own masks. At each state it ranks the allowed tokens by what
they do to the text (a closing quote first, then digits, closing brackets, a lone comma (the way
to the next required property or item where nothing closes yet), words, other characters,
whitespace, and last what opens something new: `{`, `[`, or a comma with more), takes the longest
token of each rank as that rank's candidate, and follows the best; a rank used six times among
the last twelve tokens is tried last, so runs end; a dead end backtracks to the next candidate.
For JSON that reads: finish the string, close the object, fill each required property with the
shortest value. The result
is short, not always the shortest: a bounded best-first walk, never an exhaustive one. Past
`_DEPTHS[0]` tokens the first path is walked out alone before the deeper passes, so that a long
closing (a schema with dozens of required properties) is found at all.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence

import numpy as np

from .base import Grammar

_CLOSERS = frozenset(b'"}])')
_OPENERS = frozenset(b"{[(,")
_SPACE = frozenset(b" \t\n\r")
_SEPARATORS = (b"@", b".", b"-", b":", b"/", b"_")  # what emails, dates, times and URIs need
_NUM_RANKS = 8
_OTHER = 5  # the rank of punctuation and mixed tokens (`_rank`)
_RANK_STRIDE = 1 << 12  # rank * stride - length: one integer to sort by
_NONE = np.iinfo(np.int64).max
_WINDOW, _REPEATS = 12, 6  # a rank used this often among the last tokens is tried last
_AVOIDED = 8  # allowed tokens looked at for one not avoided (`_best_allowed`)
_SEPARATORS_AVOIDED = 2  # the last punctuation tokens tried after the others (`_candidates`)
# The straight walks tried before backtracking: (shortest tokens?, the ranks' order, `repeats`,
# share of the time). Longest
# tokens cover ground fastest; where lengths are bounded (an email's labels, `maxLength`) they
# overrun them, and where a pattern ends in letters (`\.[A-Za-z]{2,}$`) digits first never end it.
_IN_ORDER = tuple(range(_NUM_RANKS))
_LETTERS_FIRST = (0, 4, 1, 2, 3, 5, 6, 7)
# The shortest tokens wear a rank out sooner (after 2 of the last 12, not 6), so they reach
# the separators of a pattern (`^pbj:([a-z0-9-]+):...`) in a few tokens. Each walk may take its
# share of the time left: the first finds most closings, some of them thousands of tokens long
# (slow on a large schema); the shortest one found is kept.
_WALKS = ((False, _IN_ORDER, 6, 0.75), (True, _IN_ORDER, 2, 0.5), (True, _LETTERS_FIRST, 2, 0.5))
_MAX_EXPANSIONS = 512  # tokens tried per search
_DEPTHS = (32, 128)  # iterative deepening, then the caller's limit
_SLICES = ((0, 32), (32, 1024), (1024, None))  # of a rank's best-first tokens, checked in turn


class ClosingSearch:
    """Finds closing token sequences for the grammars of one tokenizer (rank table built once)."""

    def __init__(
        self, token_bytes: Sequence[bytes], num_words: int, excluded: Iterable[int] = ()
    ) -> None:
        """`excluded`: ids never proposed (special tokens, EOS)."""
        self.num_words = num_words
        order = np.full(num_words * 32, _NONE, dtype=np.int64)
        skip = set(excluded)
        for token_id, spelled in enumerate(token_bytes):
            if spelled and token_id not in skip:
                rank = _rank(spelled)
                # longest first; punctuation shortest first, separators before all: `@`, not `####`
                size = min(len(spelled), _RANK_STRIDE - 1)
                if spelled == b'""':
                    size = _RANK_STRIDE - 1  # an empty string in one token, before `"]}`
                if rank == _OTHER:  # separators in their listed order: `@` before `-`
                    at = _SEPARATORS.index(spelled) if spelled in _SEPARATORS else None
                    size = (
                        _RANK_STRIDE - 1 - at
                        if at is not None
                        else _RANK_STRIDE - 1 - len(_SEPARATORS) - size
                    )
                order[token_id] = rank * _RANK_STRIDE - size
        self.order = order
        # each rank's tokens, best first, with where their bits sit in a mask row
        listed = np.flatnonzero(order != _NONE)
        ranks = order[listed] // _RANK_STRIDE + 1
        # and the same lists shortest first, for the walks of shortest tokens (`_WALKS`)
        lengths = np.array([len(token_bytes[i]) for i in listed], dtype=np.int64)
        self._by_rank: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._by_rank_short: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for rank in range(_NUM_RANKS):
            ids = listed[ranks == rank]
            short = (
                order[ids] if rank == _OTHER else lengths[ranks == rank]
            )  # punctuation: already so
            for lists, key in ((self._by_rank, order[ids]), (self._by_rank_short, short)):
                picked = ids[np.argsort(key, kind="stable")]
                lists.append((picked, picked >> 5, (picked & 31).astype(np.uint32)))

    def shortest_completion(
        self, grammar: Grammar, max_tokens: int, time_limit: float = 0.05
    ) -> list[int] | None:
        """Tokens (at most `max_tokens`) after which `grammar` accepts; [] when it already does;
        None when none were found within the search's bounds (512 tokens tried, `time_limit`
        seconds). `grammar` is left unchanged."""
        if grammar.accepts_eos():
            return []
        deadline = time.perf_counter() + time_limit
        row = np.zeros((1, self.num_words), dtype=np.int32)  # per search: one may run on a thread
        depths = (*[d for d in _DEPTHS if d < max_tokens], max_tokens)
        left = _MAX_EXPANSIONS
        for i, depth in enumerate(depths):
            if i == 1:
                # NOTE: past the shallow pass, straight walks first: the deeper passes start
                # with the first one's path but, sharing the expansions, cannot follow it past a
                # few hundred tokens (deep documents, schemas with dozens of required properties)
                best: list[int] | None = None
                for short, ranks, repeats, share in _WALKS:
                    now = time.perf_counter()
                    until = now + (deadline - now) * share
                    limit = max_tokens if best is None else len(best) - 1
                    found = self._walk(grammar.copy(), limit, until, row, short, ranks, repeats)
                    if found is not None:
                        best = found
                    if time.perf_counter() > deadline:
                        break
                if best is not None or time.perf_counter() > deadline:
                    return best
            # NOTE: a shallow pass may not spend what the deeper ones need: a closing longer
            # than 32 tokens would otherwise be crowded out by the exhaustive short pass
            budget = [left if i == len(depths) - 1 else left // 3]
            found = self._search(grammar.copy(), depth, budget, deadline, row)
            left -= (left if i == len(depths) - 1 else left // 3) - budget[0]
            if found is not None or left <= 0 or time.perf_counter() > deadline:
                return found
        return None

    def _walk(
        self,
        probe: Grammar,
        max_tokens: int,
        deadline: float,
        row: np.ndarray,
        short: bool,
        ranks: tuple[int, ...],
        repeats: int,
    ) -> list[int] | None:
        """One path without backtracking: the first allowed candidate each time (`short`: each
        rank's shortest token, not its best; `ranks`: the ranks in the order tried; `repeats`:
        as `_candidates`)."""
        path: list[int] = []
        while len(path) < max_tokens and time.perf_counter() < deadline:
            for token_id in self._candidates(probe, path, row, short, ranks, repeats):
                if probe.try_advance(token_id):
                    path.append(token_id)
                    break
            else:
                return None
            if probe.accepts_eos():
                return path
        return None

    def _search(
        self, probe: Grammar, max_depth: int, budget: list[int], deadline: float, row: np.ndarray
    ) -> list[int] | None:
        """Depth-first over each state's candidates, at most `max_depth` tokens deep."""
        path: list[int] = []
        stack: list[list[int]] = [self._candidates(probe, path, row)]
        while stack and budget[0] > 0 and time.perf_counter() < deadline:
            options = stack[-1]
            if not options or len(path) >= max_depth:
                stack.pop()
                if path:
                    path.pop()
                    probe.rollback(1)
                continue
            token_id = options.pop(0)
            budget[0] -= 1
            if not probe.try_advance(token_id):
                continue
            path.append(token_id)
            if probe.accepts_eos():
                return path
            stack.append(self._candidates(probe, path, row))
        return None

    def _candidates(
        self,
        grammar: Grammar,
        path: list[int],
        row: np.ndarray,
        short: bool = False,
        ranks: tuple[int, ...] = _IN_ORDER,
        repeats: int = _REPEATS,
    ) -> list[int]:
        """The best allowed token of each rank, best rank first. A rank used `repeats` times
        among the last `_WINDOW` tokens of `path` goes last, with another token than the last
        one (more digits rarely bring the end closer; where only digits may follow, another
        digit might)."""
        grammar.fill_bitmask(row, 0)
        words = row[0].view(np.uint32)
        recent = [self._rank_of(t) for t in path[-_WINDOW:]]
        worn = {r for r in set(recent) if recent.count(r) >= repeats}
        found: list[tuple[int, int]] = []
        separators = self._last_separators(path)
        for place, rank in enumerate(ranks):
            avoid = {path[-1]} if rank in worn else set()
            if rank == _OTHER:  # separators in turn: `-`, then `:` where a pattern needs both
                avoid |= separators
            token_id = self._best_allowed(words, rank, avoid, short)
            if token_id >= 0:
                found.append((place + (_NUM_RANKS if rank in worn else 0), token_id))
        return [token_id for _, token_id in sorted(found)]

    def _last_separators(self, path: list[int]) -> set[int]:
        """The last `_SEPARATORS_AVOIDED` punctuation tokens of `path` (among its last 64)."""
        found: set[int] = set()
        for token_id in reversed(path[-64:]):
            if self._rank_of(token_id) == _OTHER:
                found.add(token_id)
                if len(found) == _SEPARATORS_AVOIDED:
                    break
        return found

    def _best_allowed(
        self, words: np.ndarray, rank: int, avoid: Collection[int], short: bool = False
    ) -> int:
        """The first token of `rank`'s best-first list that the mask allows, other than those in
        `avoid` unless only they are; -1 if none. Looked for in growing slices: in a string
        nearly everything is allowed, elsewhere a few tokens are."""
        ids, word, shift = (self._by_rank_short if short else self._by_rank)[rank]
        fallback = -1
        for lo, hi in _SLICES:
            if lo >= ids.size:
                break
            hits = np.flatnonzero((words[word[lo:hi]] >> shift[lo:hi]) & 1)
            for hit in hits[:_AVOIDED]:
                token_id = int(ids[lo + hit])
                if token_id not in avoid:
                    return token_id
                if fallback < 0:
                    fallback = token_id
            if hits.size > _AVOIDED:
                return int(ids[lo + hits[_AVOIDED]])
        return fallback

    def _rank_of(self, token_id: int) -> int:
        return int(self.order[token_id] // _RANK_STRIDE + 1)


def _rank(spelled: bytes) -> int:
    if spelled.startswith(b" ") and spelled.lstrip(b" "):  # after `: ` in spaced JSON
        core = spelled.lstrip(b" ")
        if core.isdigit():
            return 1
        if core == b"-":
            return 7  # a sign: a number's own digits are shorter
    if all(b in _CLOSERS for b in spelled) and spelled[0] == ord('"'):
        return 0  # a quote first: inside a string it ends the string
    if spelled.isdigit():
        return 1  # before brackets: patterns and formats ask for digits more than for `)`
    if all(b in _CLOSERS for b in spelled):
        return 2
    if spelled == b",":
        return 3  # before words and punctuation: a number that may end, ends
    if spelled.isalpha():
        return 4
    if all(b in _SPACE for b in spelled):
        return 6
    if any(b in _OPENERS for b in spelled):
        return 7
    return _OTHER
