"""Prefill–decode handoff: a prompt's KV moved out of the pool of the engine that prefilled it
and into the pool of the engine that decodes it, as one *run* of whole pages named the way every
tier names its blocks.

- **Export** (the prefill side, on the loop): when a prefill-only request finishes, the whole
  pages of its prompt (all but the last token, which the decoding engine computes to get its
  first logits) are copied out of the pool (`PoolBlockIO.gather`, the copy demotion makes) before
  a later step may evict them. Off the loop, `encode` lays them out and gives them a block header:
  the run's last page name, the salt and layout digests, a CRC-32 of the payload.
- **Import** (the decode side): off the loop, `check` verifies the header against this engine's
  own salt and layout and the names of the run's tokens (another model, KV dtype or page size is
  `foreign`, a bad checksum `corrupt`); on the loop, `apply` copies the pages the radix cache
  lacks into fresh ones and caches them, where the request that follows finds them as its cached
  prefix. They stay *held* (locked) until a request whose prompt starts with them is admitted, or
  `HANDOFF_HOLD_SECONDS` pass.

A run that fails a check, or finds no room in the pool, is a miss: the request prefills there.

On the wire a run is `PLKR`, a version, the token count, the token ids (int32, little-endian),
the block header, the payload; a message is runs back to back (`encode_runs`, `decode_runs`).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import sys
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Any

from plait.radix_cache import RadixCache, chain_names, root_name
from plait.runtime.kv_pool import KVPool
from plait.runtime.kv_tiers.block_format import (
    HEADER_BYTES,
    BlockCodec,
    BlockError,
    declared_size,
)
from plait.runtime.kv_tiers.pool_io import PoolBlockIO, Snapshot
from plait.runtime.request import Request, RequestStatus
from plait.runtime.tuning import HANDOFF_HOLD_SECONDS, HANDOFF_MAX_HELD_FRACTION

logger = logging.getLogger("plait.kv_tiers")

RUN_MAGIC = b"PLKR"
RUN_VERSION = 1
_RUN = struct.Struct("<4sHI")  # magic, version, number of tokens
FAILURE_KINDS = ("truncated", "corrupt", "foreign", "no_room")


@dataclass
class KVRun:
    """The KV of the whole pages of `tokens` (a prompt's leading tokens), as one block."""

    tokens: list[int]
    header: bytes  # the block header (`block_format`): name, salt, layout, size, CRC-32
    payload: memoryview  # [num_layers, 2, pages, page_size, num_kv_heads, head_dim], then scales

    @property
    def nbytes(self) -> int:
        return _RUN.size + 4 * len(self.tokens) + HEADER_BYTES + len(self.payload)


@dataclass
class Exported:
    """A run copied out of the pool on the loop, not yet laid out (`KVHandoff.encode`)."""

    tokens: list[int]
    io: PoolBlockIO
    snapshot: Snapshot


@dataclass
class _Hold:
    node: Any  # the radix node locked for the run
    tokens: list[int]
    expires: float  # perf_counter time
    claimed_by: Request | None = None


@dataclass(frozen=True)
class ImportResult:
    runs: int  # runs received
    tokens: int  # tokens those runs cover that the pool now caches
    new_tokens: int  # of those, tokens copied in (the rest were cached already)
    failures: tuple[str, ...] = ()  # why a run was a miss

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "failures": list(self.failures)}


def encode_runs(runs: list[KVRun]) -> list[bytes | memoryview]:
    """The message carrying `runs`, as buffers to send one after the other."""
    parts: list[bytes | memoryview] = []
    for run in runs:
        ids = array("i", run.tokens)
        if sys.byteorder == "big":
            ids.byteswap()
        parts += [_RUN.pack(RUN_MAGIC, RUN_VERSION, len(run.tokens)), ids.tobytes(), run.header]
        parts.append(run.payload)
    return parts


def decode_runs(data: bytes | memoryview) -> list[KVRun]:
    """The runs of a message (payloads are views of `data`); BlockError if it is cut short or is
    not one."""
    view = memoryview(data).cast("B")
    runs: list[KVRun] = []
    pos = 0
    while pos < len(view):
        if len(view) - pos < _RUN.size:
            raise BlockError("truncated", "a KV run cut short in its preamble")
        magic, version, num_tokens = _RUN.unpack_from(view, pos)
        if magic != RUN_MAGIC or version != RUN_VERSION:
            raise BlockError("corrupt", f"not a plait KV run (magic {magic!r}, version {version})")
        pos += _RUN.size
        end = pos + 4 * num_tokens + HEADER_BYTES
        if end > len(view):
            raise BlockError("truncated", "a KV run cut short in its tokens or header")
        ids = array("i", view[pos : pos + 4 * num_tokens].tobytes())
        if sys.byteorder == "big":
            ids.byteswap()
        header = bytes(view[end - HEADER_BYTES : end])
        size = declared_size(header)
        if end + size > len(view):
            raise BlockError("truncated", f"a KV run's payload of {size} bytes is cut short")
        runs.append(KVRun(ids.tolist(), header, view[end : end + size]))
        pos = end + size
    return runs


class KVHandoff:
    """One engine's side of the handoff. `export`, `apply`, `claim`, `expire` and `release_all`
    run on the engine loop; `encode` and `check` anywhere (they touch no engine state)."""

    def __init__(self, pool: KVPool, cache: RadixCache, salt: bytes) -> None:
        self.pool = pool
        self.cache = cache
        self.page_size = cache.page_size
        self.salt = salt
        self.root = root_name(salt)
        self.layout = PoolBlockIO(pool, 1).layout
        self._holds: list[_Hold] = []
        self._max_held_pages = int(pool.num_pages * HANDOFF_MAX_HELD_FRACTION)
        self._lock = threading.Lock()  # `counts` is bumped by the loop and by callers' threads
        self.counts: Counter[str] = Counter()

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    # the prefill side --------------------------------------------------------------------------

    def export(self, req: Request) -> Exported | None:
        """Copies the cached whole pages of `req`'s prompt but its last token out of the pool
        (on the loop, right after the request finished); None if there are none."""
        ps = self.page_size
        end = (len(req.prompt_ids) - 1) // ps * ps
        match = self.cache.match_prefix(req.prompt_ids[:end], record=False)
        if not match.pages:
            return None
        io = PoolBlockIO(self.pool, len(match.pages))
        return Exported(req.prompt_ids[: match.num_tokens], io, io.gather(match.pages))

    def encode(self, exported: Exported) -> KVRun:
        """The run of an export, laid out with its header (off the loop)."""
        payload = exported.io.payload(exported.snapshot, 0)
        name = chain_names(self.root, exported.tokens, self.page_size)[-1]
        header = BlockCodec(self.salt, exported.io.layout).header(name, payload)
        self.count("exports")
        self.count("exported_tokens", len(exported.tokens))
        self.count("exported_bytes", len(payload))
        return KVRun(exported.tokens, header, payload)

    # the decode side ---------------------------------------------------------------------------

    def check(self, run: KVRun) -> memoryview:
        """The run's payload if it is this engine's KV of its tokens; else BlockError (counted)."""
        try:
            num_pages, partial = divmod(len(run.tokens), self.page_size)
            if num_pages == 0 or partial:
                raise BlockError("corrupt", f"{len(run.tokens)} tokens are not whole pages")
            layout = dataclasses.replace(self.layout, block_pages=num_pages)
            name = chain_names(self.root, run.tokens, self.page_size)[-1]
            return BlockCodec(self.salt, layout).check(name, run.header, run.payload)
        except BlockError as exc:
            self.count(exc.kind)
            raise

    def apply(self, run: KVRun, payload: memoryview, kv: Any) -> tuple[int, int]:
        """Caches the run's pages (`kv`: the scheduler's KVCacheManager, which finds fresh pages)
        and holds them for the request that follows: (tokens cached, tokens copied in)."""
        ps = self.page_size
        tokens = run.tokens
        match = self.cache.match_prefix(tokens, record=False)
        start = match.num_tokens
        new = len(tokens) - start
        if new > 0:
            self.cache.lock(match.node)
            try:
                pages = kv.allocate(new // ps)
                if pages is None:
                    self.count("no_room")
                    return start, 0
                io = PoolBlockIO(self.pool, len(tokens) // ps)
                io.scatter(payload, start // ps, pages)
                self.cache.insert(tokens, match.pages + pages)
            finally:
                self.cache.unlock(match.node)
            match = self.cache.match_prefix(tokens, record=False)
        self._hold(match.node, tokens)
        self.count("imports")
        self.count("imported_tokens", new)
        self.count("imported_bytes", len(payload) * new // len(tokens))
        return len(tokens), new

    def _hold(self, node: Any, tokens: list[int]) -> None:
        self.cache.lock(node)
        self._holds.append(_Hold(node, tokens, time.perf_counter() + HANDOFF_HOLD_SECONDS))
        held = sum(len(h.tokens) for h in self._holds) // self.page_size
        while held > self._max_held_pages and len(self._holds) > 1:
            oldest = self._holds.pop(0)  # its pages stay cached, only evictable again
            self.cache.unlock(oldest.node)
            held -= len(oldest.tokens) // self.page_size

    def claim(self, req: Request) -> None:
        """A request arrived: the holds its prompt starts with end once it is admitted."""
        prompt = req.prompt_ids
        for hold in self._holds:
            n = len(hold.tokens)
            if hold.claimed_by is None and len(prompt) >= n and prompt[:n] == hold.tokens:
                hold.claimed_by = req

    def expire(self) -> None:
        """Ends the holds whose request was admitted (it locks the pages itself) or left, and
        those past their time."""
        if not self._holds:
            return
        now = time.perf_counter()
        kept = []
        for hold in self._holds:
            req = hold.claimed_by
            if req is not None and req.status is not RequestStatus.WAITING:
                self.cache.unlock(hold.node)
            elif now >= hold.expires:
                self.cache.unlock(hold.node)
                self.count("expired_holds")
            else:
                kept.append(hold)
        self._holds = kept

    def release_all(self) -> None:
        for hold in self._holds:
            self.cache.unlock(hold.node)
        self._holds = []

    # introspection -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = Counter(self.counts)
        out: dict[str, Any] = {
            f"kv_handoff_{k}": c[k]
            for k in (
                "exports",
                "exported_tokens",
                "exported_bytes",
                "imports",
                "imported_tokens",
                "imported_bytes",
                "expired_holds",
            )
        }
        out["kv_handoff_holds"] = len(self._holds)
        out["kv_handoff_failures"] = sum(c[k] for k in FAILURE_KINDS)
        out.update({f"kv_handoff_failures_{k}": c[k] for k in FAILURE_KINDS})
        return out
