"""The local disk tier: one file per block under a directory, surviving restarts.

A block named `n` lives at `DIR/<first two hex digits of n>/<hex of n>.kvb`. It is written to a
temporary file under `DIR/tmp/` and renamed into place, so a reader sees a whole file or none; a
process killed mid-write leaves only a temporary file, which the next engine removes. The
directory is indexed lazily: lookups go straight to the file system (a name is a path), while a
background scan learns what earlier processes stored, for the size limit's least-recently-used
order. A full disk turns writes off (the engine then caches in memory only) with a warning.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict

from plait.runtime.kv_tiers.tier import KVTier

logger = logging.getLogger("plait.kv_tiers")

_SUFFIX = ".kvb"
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# a temporary file this old belongs to no running write, whoever made it
_STALE_TMP_SECONDS = 600.0
# after the disk filled up, writes are tried again this much later (space may have been freed)
_FULL_RETRY_SECONDS = 60.0


class DiskTier(KVTier):
    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int) -> None:
        super().__init__()
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.capacity_bytes = capacity_bytes
        self._tmp = os.path.join(self.directory, "tmp")
        os.makedirs(self._tmp, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # name -> bytes, least recent first
        self._bytes = 0
        self._scanned = threading.Event()
        self.full = False
        self._full_at = 0.0
        self._serial = 0
        self._scanner = threading.Thread(target=self._scan, name="plait-kv-disk-scan", daemon=True)
        self._scanner.start()

    def path(self, name: bytes) -> str:
        hexname = name.hex()
        return os.path.join(self.directory, hexname[:2], hexname + _SUFFIX)

    # reads --------------------------------------------------------------------------------

    def contains(self, names: list[bytes]) -> list[bool]:
        return [os.path.exists(self.path(n)) for n in names]

    def get(self, names: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for name in names:
            try:
                with open(self.path(name), "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                out.append(None)
                continue
            except OSError as exc:
                logger.warning("kv disk: reading block %s failed: %s", name.hex(), exc)
                self.stats.add("io")
                out.append(None)
                continue
            self._touch(name, len(data))
            out.append(data)
        return out

    # writes -------------------------------------------------------------------------------

    def put(self, name: bytes, header: bytes, payload: memoryview) -> bool:
        if self.full and time.monotonic() - self._full_at < _FULL_RETRY_SECONDS:
            return False
        final = self.path(name)
        with self._lock:
            self._serial += 1
            tmp = os.path.join(self._tmp, f"{name.hex()}.{os.getpid()}.{self._serial}.tmp")
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, header)
                _write_all(fd, payload)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as exc:
            _remove(tmp)
            if exc.errno in _FULL_ERRNOS:
                self.full, self._full_at = True, time.monotonic()
                self.stats.add("full")
                logger.warning(
                    "kv disk: %s is full (%s); KV blocks are no longer written to disk, the "
                    "engine caches in memory only",
                    self.directory,
                    exc,
                )
            else:
                self.stats.add("io")
                logger.warning("kv disk: writing block %s failed: %s", name.hex(), exc)
            return False
        self.full = False
        self.stats.add("demotions")
        self._touch(name, len(header) + len(payload))
        self._shrink()
        return True

    def discard(self, name: bytes) -> None:
        _remove(self.path(name))
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._bytes -= size

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._index), self._bytes

    # the index ----------------------------------------------------------------------------

    def _touch(self, name: bytes, size: int) -> None:
        with self._lock:
            old = self._index.pop(name, None)
            self._bytes += size - (old or 0)
            self._index[name] = size

    def _shrink(self) -> None:
        """Removes least recently used blocks while over capacity (once the scan has run: until
        then the index does not know what earlier processes stored)."""
        if not self._scanned.is_set():
            return
        while True:
            with self._lock:
                if self._bytes <= self.capacity_bytes or not self._index:
                    return
                name, size = self._index.popitem(last=False)
                self._bytes -= size
            _remove(self.path(name))

    def _scan(self) -> None:
        """Learns the blocks already on disk (oldest first) and removes dead temporary files."""
        try:
            found: list[tuple[float, bytes, int]] = []
            for sub in sorted(os.listdir(self.directory)):
                folder = os.path.join(self.directory, sub)
                if sub == "tmp" or len(sub) != 2 or not os.path.isdir(folder):
                    continue
                with os.scandir(folder) as entries:
                    for entry in entries:
                        if not entry.name.endswith(_SUFFIX):
                            continue
                        try:
                            name = bytes.fromhex(entry.name[: -len(_SUFFIX)])
                            st = entry.stat()
                        except (ValueError, OSError):
                            continue
                        found.append((st.st_mtime, name, st.st_size))
            found.sort()
            with self._lock:
                known = self._index
                self._index = OrderedDict((n, size) for _, n, size in found if n not in known)
                self._index.update(known)  # what this process touched meanwhile is newer
                self._bytes = sum(self._index.values())
            self._remove_dead_tmp()
        except OSError as exc:
            logger.warning("kv disk: indexing %s failed: %s", self.directory, exc)
            self.stats.add("io")
        finally:
            self._scanned.set()
        self._shrink()

    def _remove_dead_tmp(self) -> None:
        now = time.time()
        for entry in os.scandir(self._tmp):
            parts = entry.name.split(".")
            pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
            try:
                stale = now - entry.stat().st_mtime > _STALE_TMP_SECONDS
            except OSError:
                continue
            if stale or pid is None or (pid != os.getpid() and not _alive(pid)):
                _remove(entry.path)

    def wait_indexed(self, timeout: float | None = None) -> bool:
        return self._scanned.wait(timeout)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
