"""Demotion: storing cached blocks in the tiers below the pool, on a thread of its own.

The engine loop hands over a snapshot of whole blocks of pages (`PoolBlockIO.gather`) and goes
on; the writer lays each block out, adds its header and stores it in every tier that lacks it.
Snapshots beyond `TIER_MAX_PENDING_WRITE_BYTES` are dropped (counted): a slow tier caches less,
the engine never waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from plait.runtime.kv_tiers.block_format import BlockCodec
from plait.runtime.kv_tiers.pool_io import PoolBlockIO, Snapshot
from plait.runtime.kv_tiers.tier import KVTier
from plait.runtime.tuning import TIER_MAX_PENDING_WRITE_BYTES

logger = logging.getLogger("plait.kv_tiers")


class BlockWriter:
    def __init__(self, tiers: list[KVTier], io: PoolBlockIO, codec: BlockCodec) -> None:
        self.tiers = tiers
        self.io = io
        self.codec = codec
        self._queue: queue.Queue[tuple[list[bytes], Snapshot] | None] = queue.Queue()
        self._lock = threading.Lock()
        self.pending_bytes = 0
        self.dropped_blocks = 0
        self._thread = threading.Thread(target=self._run, name="plait-kv-writer", daemon=True)
        self._thread.start()

    def submit(self, names: list[bytes], snapshot: Snapshot) -> bool:
        with self._lock:
            if self.pending_bytes + snapshot.nbytes > TIER_MAX_PENDING_WRITE_BYTES:
                self.dropped_blocks += len(names)
                return False
            self.pending_bytes += snapshot.nbytes
        self._queue.put((names, snapshot))
        return True

    def has_room(self) -> bool:
        return self.pending_bytes < TIER_MAX_PENDING_WRITE_BYTES

    def close(self, timeout: float) -> bool:
        """Stores what is queued (for at most `timeout` seconds), then stops; True if all was."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            names, snapshot = item
            try:
                self._store(names, snapshot)
            except Exception:  # a writer that died would silently stop all demotion
                logger.exception("kv tiers: storing %d blocks failed", len(names))
            finally:
                with self._lock:
                    self.pending_bytes -= snapshot.nbytes

    def _store(self, names: list[bytes], snapshot: Snapshot) -> None:
        present = [tier.contains(names) for tier in self.tiers]
        for i, name in enumerate(names):
            missing = [t for t, have in zip(self.tiers, present) if not have[i]]
            if not missing:
                continue
            payload = self.io.payload(snapshot, i)
            header = self.codec.header(name, payload)
            for tier in missing:
                tier.put(name, header, payload)

    def wait_idle(self, timeout: float) -> bool:
        """Until every queued snapshot is stored (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.pending_bytes > 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True
