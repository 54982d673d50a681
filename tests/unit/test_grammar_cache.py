"""The compiled-grammar cache: in-flight deduplication, error caching, eviction, and that callers
never block on a slow compilation."""

from __future__ import annotations

import threading
import time

import pytest

from plait.runtime.constrained import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCache,
    GrammarError,
    GrammarKey,
    InvalidRegexError,
    make_grammar_key,
)
from tests.unit.grammar_support import backend_for


class FakeCompiled(CompiledGrammar):
    def __init__(self, key: GrammarKey) -> None:
        self.key = key
        self.regex = key.pattern

    def new_grammar(self):
        raise NotImplementedError


class SlowBackend(GrammarBackend):
    name = "slow"

    def __init__(self, delay: float = 0.2, gated: bool = False) -> None:
        self.delay = delay
        self.calls: list[GrammarKey] = []
        self.gated = gated
        self.release = threading.Event()  # a gated compile waits for it

    def compile(self, key: GrammarKey) -> CompiledGrammar:
        self.calls.append(key)
        if self.gated:
            assert self.release.wait(timeout=30)  # a hang guard
        time.sleep(self.delay)
        if key.pattern == "bad":
            raise GrammarError("regex: bad")
        if key.pattern == "crash":
            raise MemoryError("transient")
        return FakeCompiled(key)


def test_concurrent_requests_share_one_compilation():
    backend = SlowBackend()
    cache = GrammarCache(backend, max_workers=4)
    key = GrammarKey("regex", "[0-9]+")
    barrier = threading.Barrier(8)
    results: list[CompiledGrammar] = []

    def submit() -> None:
        barrier.wait()
        results.append(cache.get(key, timeout=5))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(backend.calls) == 1 and cache.stats.num_compiles == 1 and cache.stats.num_hits == 7
    assert len({id(r) for r in results}) == 1
    cache.get(key)
    assert len(backend.calls) == 1 and cache.stats.num_hits == 8
    cache.shutdown()


def test_get_future_never_blocks():
    backend = SlowBackend(delay=0.0, gated=True)
    cache = GrammarCache(backend)
    future = cache.get_future(GrammarKey("regex", "a"))  # the build cannot finish yet
    assert not future.done()
    backend.release.set()
    assert future.result(timeout=30).regex == "a"
    assert cache.stats.num_compiles == 1
    cache.shutdown()


def test_errors_are_cached_but_crashes_are_not():
    backend = SlowBackend(delay=0.0)
    cache = GrammarCache(backend)
    bad = GrammarKey("regex", "bad")
    for _ in range(2):
        with pytest.raises(GrammarError, match="regex: bad"):
            cache.get(bad)
    assert len(backend.calls) == 1 and cache.stats.num_errors == 1
    crash = GrammarKey("regex", "crash")
    for _ in range(2):
        with pytest.raises(MemoryError):
            cache.get(crash)
    assert backend.calls.count(crash) == 2
    cache.shutdown()


def test_eviction_keeps_the_newest():
    backend = SlowBackend(delay=0.0)
    cache = GrammarCache(backend, max_entries=3)
    keys = [GrammarKey("regex", str(i)) for i in range(5)]
    for key in keys:
        cache.get(key)
    cache.get_future(GrammarKey("regex", "x")).result()
    assert len(cache) <= 3 + 1 and keys[0] not in cache and GrammarKey("regex", "x") in cache
    cache.get(keys[0])
    assert backend.calls.count(keys[0]) == 2
    cache.shutdown()


class SizedBackend(SlowBackend):
    def compile(self, key: GrammarKey) -> CompiledGrammar:
        compiled = super().compile(key)
        compiled.nbytes = int(key.pattern.split(":")[0])
        return compiled


def test_cached_bytes_are_bounded():
    """Large compiled grammars (outlines indexes) push older ones out past `max_bytes`; one
    larger than the budget alone is still handed to its request."""
    cache = GrammarCache(SizedBackend(delay=0.0), max_bytes=250)
    keys = [GrammarKey("regex", f"100:{i}") for i in range(4)]
    for key in keys:
        assert cache.get(key).nbytes == 100
        assert cache.nbytes <= 250
    assert keys[-1] in cache and keys[0] not in cache and cache.nbytes == 200
    huge = GrammarKey("regex", "1000:x")
    assert cache.get(huge).nbytes == 1000
    assert huge in cache and len(cache) == 1
    cache.shutdown()


def test_real_backend_through_the_cache(smollm_tokenizer):
    cache = GrammarCache(backend_for(smollm_tokenizer))
    key = make_grammar_key(
        json_schema={
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
        },
        json_whitespace="compact",
    )
    assert cache.get(key).regex.startswith('\\{"ok":')
    with pytest.raises(InvalidRegexError, match="regex: invalid pattern"):
        cache.get_future(make_grammar_key(regex="[a-")).result(timeout=10)
    cache.shutdown()
