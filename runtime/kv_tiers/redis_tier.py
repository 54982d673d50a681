"""The Redis tier: KV blocks shared between engines (replicas, machines) through a Redis server.

A block named `n` is the value of key `plait:kv:<hex of n>`, header and payload as on disk. It is
set only if absent (a name always holds the same KV), never expires by itself: size and eviction
are the server's (`maxmemory` with an `allkeys-lru` policy is the usual setting). Every command
has a short timeout; a server that times out or cannot be reached is left alone for a few
seconds, and everything asked of it meanwhile is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from plait.runtime.kv_tiers.tier import KVTier

logger = logging.getLogger("plait.kv_tiers")

T = TypeVar("T")

KEY_PREFIX = b"plait:kv:"
# seconds a command may take before it is a miss; then the server is skipped for a while
COMMAND_TIMEOUT_SECONDS = 0.5
RETRY_SECONDS = 2.0


class RedisTier(KVTier):
    name = "redis"

    def __init__(self, url: str) -> None:
        super().__init__()
        import redis

        self._errors = (redis.RedisError, OSError)
        self._timeouts = (redis.TimeoutError, TimeoutError)
        self.url = url
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=COMMAND_TIMEOUT_SECONDS,
            socket_connect_timeout=COMMAND_TIMEOUT_SECONDS,
        )
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._blocks = 0
        self._bytes = 0

    @staticmethod
    def key(name: bytes) -> bytes:
        return KEY_PREFIX + name.hex().encode()

    def contains(self, names: list[bytes]) -> list[bool]:
        def ask() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(self.key(name))
            return [bool(n) for n in pipe.execute()]

        return self._call(ask, [False] * len(names))

    def get(self, names: list[bytes]) -> list[bytes | None]:
        return self._call(
            lambda: self._client.mget([self.key(n) for n in names]), [None] * len(names)
        )

    def put(self, name: bytes, header: bytes, payload: memoryview) -> bool:
        data = header + bytes(payload)
        stored = self._call(lambda: self._client.set(self.key(name), data, nx=True), None)
        if stored is None:
            return False
        if stored:
            with self._lock:
                self._blocks += 1
                self._bytes += len(data)
            self.stats.add("demotions")
        return True

    def discard(self, name: bytes) -> None:
        self._call(lambda: self._client.delete(self.key(name)), 0)

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return self._blocks, self._bytes

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass

    def _call(self, command: Callable[[], T], miss: T) -> T:
        """Runs a command; on a failure (or while the server is skipped) counts it and returns
        `miss`."""
        if time.monotonic() < self._down_until:
            self.stats.add("unavailable")
            return miss
        try:
            return command()
        except self._errors as exc:
            kind = "timeout" if isinstance(exc, self._timeouts) else "unavailable"
            self.stats.add(kind)
            with self._lock:
                was_up = time.monotonic() >= self._down_until
                self._down_until = time.monotonic() + RETRY_SECONDS
            if was_up:
                logger.warning(
                    "kv redis: %s failed (%s: %s); its blocks are misses for %.0f s",
                    self.url,
                    type(exc).__name__,
                    exc,
                    RETRY_SECONDS,
                )
            return miss

    def __repr__(self) -> str:
        return f"RedisTier({self.url!r})"
