"""The interface every KV tier below the pool implements, and the counters each one keeps."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter

FAILURE_KINDS = ("truncated", "corrupt", "foreign", "io", "full", "timeout", "unavailable")


class TierStats:
    """Counters of one tier, safe to bump from any thread. `lookups`/`hits` count blocks asked
    for and found; `promotions` blocks loaded into the pool from here, `demotions` blocks written
    here; `load_seconds` the time spent reading promoted blocks; `failures` by kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.load_seconds = 0.0

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def add_load(self, seconds: float) -> None:
        with self._lock:
            self.counts["loads"] += 1
            self.load_seconds += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            counts = dict(self.counts)
            load_seconds = self.load_seconds
        lookups, loads = counts.get("lookups", 0), counts.get("loads", 0)
        out: dict[str, float] = {
            "lookups": lookups,
            "hits": counts.get("hits", 0),
            "hit_rate": counts.get("hits", 0) / lookups if lookups else 0.0,
            "promotions": counts.get("promotions", 0),
            "demotions": counts.get("demotions", 0),
            "load_seconds_mean": load_seconds / loads if loads else 0.0,
            "failures": sum(counts.get(k, 0) for k in FAILURE_KINDS),
        }
        out.update({f"failures_{k}": counts.get(k, 0) for k in FAILURE_KINDS})
        return out


class KVTier(ABC):
    """A store of KV blocks by name (a `bytes` content address), below the pool.

    Each method may be called from the tiers' writer and loader threads at once. A tier never
    raises for a failure of its storage: a block it cannot read is a miss (`None`), a block it
    cannot write is not written (`False`), and the failure is logged and counted in `stats`
    under its kind. What a tier returns is unchecked: the caller verifies each block's header
    and checksum and `discard`s a bad one."""

    name: str

    def __init__(self) -> None:
        self.stats = TierStats()

    @abstractmethod
    def contains(self, names: list[bytes]) -> list[bool]:
        """Whether each block is stored (a cheap check; a later `get` may still miss)."""

    @abstractmethod
    def get(self, names: list[bytes]) -> list[bytes | None]:
        """The stored bytes (header and payload) of each block, None where missing or failed."""

    @abstractmethod
    def put(self, name: bytes, header: bytes, payload: memoryview) -> bool:
        """Stores a block (replacing nothing: a stored name holds the same KV); False if not."""

    @abstractmethod
    def discard(self, name: bytes) -> None:
        """Drops a block found bad."""

    @abstractmethod
    def usage(self) -> tuple[int, int]:
        """(blocks, bytes) stored, as far as this process knows."""

    def close(self) -> None:  # noqa: B027 (most tiers hold nothing to let go of)
        """Lets go of files, connections and threads."""
