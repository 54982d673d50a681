"""Shared helpers for the grammar tests: the corpora, one backend and cache per tokenizer for the
whole test run, and a random walk that drives a grammar through its masks."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from plait.kernels.constraint_mask import allocate_token_bitmask
from plait.runtime.constrained import (
    GrammarCache,
    GrammarKey,
    create_grammar_backend,
    jump_forward,
)
from plait.runtime.constrained.outlines_backend import (
    OutlinesBackend,
    OutlinesCompiledGrammar,
    OutlinesGrammar,
)

DATA = Path(__file__).resolve().parents[1] / "data"


@cache
def regex_corpus() -> list[dict]:
    return json.loads((DATA / "regex_corpus.json").read_text(encoding="utf-8"))


@cache
def schema_corpus() -> list[dict]:
    return json.loads((DATA / "schema_corpus.json").read_text(encoding="utf-8"))


@cache
def backend_for(tokenizer) -> OutlinesBackend:
    return create_grammar_backend("outlines", tokenizer)  # type: ignore[return-value]


@cache
def backend_named(tokenizer, name: str):
    return create_grammar_backend(name, tokenizer)


@cache
def cache_for(tokenizer) -> GrammarCache:
    return GrammarCache(backend_for(tokenizer), max_workers=2, max_entries=256)


def compile_key(tokenizer, key: GrammarKey) -> OutlinesCompiledGrammar:
    return cache_for(tokenizer).get(key)  # type: ignore[return-value]


def allowed_ids(bitmask_row) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


class ByteDistances:
    """Byte-level distance from each index state to acceptance, over single-byte tokens."""

    def __init__(self, compiled: OutlinesCompiledGrammar) -> None:
        self.compiled = compiled
        self.edges: dict[int, list[tuple[int, int]]] = {}  # state -> [(token id, next state)]
        self.distance: dict[int, int] = {}
        self._explore(compiled.index.get_initial_state())

    def _explore(self, start: int) -> None:
        index, singles = self.compiled.index, self.compiled.backend.single_byte_tokens
        todo = deque([start])
        while todo:
            state = todo.popleft()
            if state in self.edges:
                continue
            out = []
            for _, token_id in singles:
                nxt = index.get_next_state(state, token_id)
                if nxt is not None:
                    out.append((token_id, nxt))
                    todo.append(nxt)
            self.edges[state] = out
        reverse: dict[int, list[int]] = {}
        for state, out in self.edges.items():
            for _, nxt in out:
                reverse.setdefault(nxt, []).append(state)
        self.distance = {s: 0 for s in self.edges if self.compiled.accepts(s)}
        todo = deque(self.distance)
        while todo:
            state = todo.popleft()
            for prev in reverse.get(state, []):
                if prev not in self.distance:
                    self.distance[prev] = self.distance[state] + 1
                    todo.append(prev)

    def descend(self, state: int, rng: np.random.Generator) -> int | None:
        """A random single-byte token that brings `state` closer to acceptance."""
        if state not in self.edges:
            self._explore(state)
        here = self.distance.get(state)
        if here is None:
            return None
        closer = [t for t, nxt in self.edges[state] if self.distance.get(nxt, here) < here]
        return int(rng.choice(closer)) if closer else None


@cache
def distances_for(compiled: OutlinesCompiledGrammar) -> ByteDistances:
    return ByteDistances(compiled)


@dataclass
class Walk:
    token_ids: list[int]  # without the final EOS
    text: str
    finished: bool  # ended with EOS
    jumps: int = 0


def random_walk(
    compiled: OutlinesCompiledGrammar,
    tokenizer,
    seed: int,
    *,
    max_steps: int = 400,
    explore_steps: int = 40,
    use_jump_forward: bool = False,
    check_every: int = 0,
) -> Walk:
    """Sample uniformly among the allowed tokens of each mask; with a probability growing to 1
    over `explore_steps`, take a byte that moves toward acceptance instead, so walks end.

    Every sampled token must be accepted by `advance` (mask and automaton agree). With
    `check_every`, every that-many steps the mask is compared with the index's allowed tokens.
    With `use_jump_forward`, forced text is appended after each step and the ids are checked to
    be the tokenizer's encoding of the text.
    """
    rng = np.random.default_rng(seed)
    grammar: OutlinesGrammar = compiled.new_grammar()
    backend = compiled.backend
    bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
    eos = tokenizer.eos_token_id
    jumps = 0
    for step in range(max_steps):
        if use_jump_forward:
            before = tokenizer.decode(list(grammar.token_ids))
            jump = jump_forward(grammar, tokenizer, min_chars=1)
            if jump is not None:
                jumps += 1
                expected = tokenizer.encode(before + jump.text, add_special_tokens=False)
                assert list(grammar.token_ids) == expected, (before, jump)
        grammar.fill_bitmask(bitmask, 0)
        allowed = allowed_ids(bitmask[0])
        assert allowed.size, f"no token allowed after {tokenizer.decode(list(grammar.token_ids))!r}"
        if check_every and step % check_every == 0:
            expected_set = set(compiled.index.get_allowed_tokens(grammar.state))
            expected_set.discard(backend.sentinel_id)
            expected_set -= set(backend.eos_token_ids)
            if grammar.accepts_eos():
                expected_set |= set(backend.eos_token_ids)
            assert set(allowed.tolist()) == expected_set
        token = None
        if rng.random() < step / explore_steps:
            token = (
                eos
                if grammar.accepts_eos()
                else distances_for(compiled).descend(grammar.state, rng)
            )
        if token is None:
            token = int(rng.choice(allowed))
        grammar.advance(token)
        if token in backend.eos_token_ids:
            ids = list(grammar.token_ids[:-1])
            return Walk(ids, _text(backend, ids), True, jumps)
    ids = list(grammar.token_ids)
    return Walk(ids, _text(backend, ids), False, jumps)


def _text(backend: OutlinesBackend, ids: list[int]) -> str:
    return b"".join(backend.token_bytes[t] for t in ids).decode("utf-8")
