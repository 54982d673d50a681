"""Compiled grammars cached per backend (one backend per tokenizer), keyed by `GrammarKey`.

Compilation runs on a small thread pool (outlines-core releases the GIL while it builds an index),
so the engine loop only polls futures. Concurrent requests for the same key share one future;
failed compilations are cached too (an invalid pattern fails the same way every time). The cache
keeps at most `max_entries` grammars and `max_bytes` of them (outlines indexes can take hundreds
of MB each); the least recently used finished ones go first, and a grammar in use by a request
lives on with it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .base import CompiledGrammar, GrammarBackend, GrammarError, GrammarKey

MAX_CACHED_BYTES = 1 << 30  # compiled grammars kept for reuse, beyond those requests hold


@dataclass
class GrammarCacheStats:
    num_compiles: int = 0  # compilations started
    num_hits: int = 0  # requests served by a finished or in-flight compilation
    num_errors: int = 0  # compilations that raised a GrammarError


class GrammarCache:
    def __init__(
        self,
        backend: GrammarBackend,
        *,
        max_workers: int = 2,
        max_entries: int = 64,
        max_bytes: int = MAX_CACHED_BYTES,
    ) -> None:
        if max_workers < 1 or max_entries < 1 or max_bytes < 1:
            raise ValueError(
                f"GrammarCache: max_workers={max_workers}, max_entries={max_entries}, "
                f"max_bytes={max_bytes}"
            )
        self.backend = backend
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.stats = GrammarCacheStats()
        self._futures: OrderedDict[GrammarKey, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="plait-grammar")

    def __len__(self) -> int:
        return len(self._futures)

    def __contains__(self, key: GrammarKey) -> bool:
        return key in self._futures

    def get_future(self, key: GrammarKey) -> Future[CompiledGrammar]:
        """The compiled grammar for `key`, compiling it in the background on a miss; never blocks.

        The future raises `GrammarError` for a pattern that does not compile.
        """
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                self.stats.num_hits += 1
                return future
            self.stats.num_compiles += 1
            future = self._pool.submit(self._compile, key)
            self._futures[key] = future
            self._evict()
        return future

    def get(self, key: GrammarKey, timeout: float | None = None) -> CompiledGrammar:
        """Blocking `get_future(key).result(timeout)`."""
        return self.get_future(key).result(timeout)

    @property
    def nbytes(self) -> int:
        """What the finished grammars in the cache hold, as their backends count it."""
        with self._lock:
            return sum(_size(f) for f in self._futures.values())

    def _compile(self, key: GrammarKey) -> CompiledGrammar:
        try:
            compiled = self.backend.compile(key)
            if compiled.nbytes:
                with self._lock:
                    self._evict(keep=key, adding=compiled.nbytes)
            return compiled
        except GrammarError:
            with self._lock:
                self.stats.num_errors += 1
            raise
        except BaseException:
            with self._lock:  # unexpected failures (out of memory, ...) are not cached
                self._futures.pop(key, None)
            raise

    def _evict(self, keep: GrammarKey | None = None, adding: int = 0) -> None:
        """Least recently used first, until both bounds hold (`adding`: bytes of `keep`, whose
        compilation is finishing). Only finished entries go; in-flight ones stay so their
        waiters keep sharing them."""
        total = adding + sum(_size(f) for f in self._futures.values())
        for key in list(self._futures):
            if len(self._futures) <= self.max_entries and total <= self.max_bytes:
                break
            future = self._futures[key]
            if key != keep and future.done():
                total -= _size(future)
                del self._futures[key]

    def clear(self) -> None:
        with self._lock:
            for key in [k for k, f in self._futures.items() if f.done()]:
                del self._futures[key]

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


def _size(future: Future[CompiledGrammar]) -> int:
    if not future.done() or future.cancelled() or future.exception() is not None:
        return 0
    return future.result().nbytes
