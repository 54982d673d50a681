"""Promotion, off the loop: finding a waiting request's next blocks in the tiers and reading them.

A `LoadJob` is made on the engine loop when a request arrives whose prompt goes past what the
pool caches. A loader thread names the prompt's blocks, asks each tier (fastest first) which it
holds, reads the longest run of consecutive blocks and checks every header and checksum; the loop
then copies the run into the pool (`KVTiers.promote`). A block that fails its check ends the run
there, and is dropped from its tier.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from plait.radix_cache import chain_names
from plait.runtime.kv_tiers.block_format import HEADER_BYTES, BlockCodec, BlockError
from plait.runtime.kv_tiers.tier import KVTier

logger = logging.getLogger("plait.kv_tiers")


@dataclass
class LoadJob:
    """The blocks `first_block`... of `tokens` (whole blocks of a prompt) to load for `req`."""

    req: Any
    tokens: list[int]
    first_block: int
    deadline: float  # perf_counter time after which the request stops waiting and prefills
    payloads: list[memoryview] = field(default_factory=list)  # the run found, from first_block
    sources: list[KVTier] = field(default_factory=list)  # the tier each payload came from
    names: list[bytes] = field(default_factory=list)
    headers: list[bytes] = field(default_factory=list)
    done: bool = False
    abandoned: bool = False  # the request went on without it
    tier: KVTier | None = None  # the tier being asked, while the job runs


def load(job: LoadJob, tiers: list[KVTier], codec: BlockCodec, root: bytes, page_size: int) -> None:
    """Fills `job.payloads` with the longest run of stored blocks from `job.first_block` on."""
    block_pages = codec.layout.block_pages
    names = chain_names(root, job.tokens, page_size)[block_pages - 1 :: block_pages]
    wanted = names[job.first_block :]
    source: list[KVTier | None] = [None] * len(wanted)
    for tier in tiers:
        ask = [i for i, s in enumerate(source) if s is None]
        if not ask or job.abandoned:
            break
        job.tier = tier
        found = tier.contains([wanted[i] for i in ask])
        tier.stats.add("lookups", len(ask))
        tier.stats.add("hits", sum(found))
        for i, hit in zip(ask, found):
            if hit:
                source[i] = tier
    run = next((i for i, s in enumerate(source) if s is None), len(source))
    got: dict[int, tuple[bytes, memoryview]] = {}
    for tier in tiers:
        mine = [i for i in range(run) if source[i] is tier]
        if not mine or job.abandoned:
            continue
        job.tier = tier
        started = time.perf_counter()
        datas = tier.get([wanted[i] for i in mine])
        tier.stats.add_load(time.perf_counter() - started)
        for i, data in zip(mine, datas):
            payload = _check(tier, codec, wanted[i], data)
            if payload is not None:
                got[i] = (bytes(memoryview(data)[:HEADER_BYTES]), payload)  # type: ignore[arg-type]
    job.tier = None
    for i in range(run):
        if i not in got:
            break
        job.headers.append(got[i][0])
        job.payloads.append(got[i][1])
        job.names.append(wanted[i])
        job.sources.append(source[i])  # type: ignore[arg-type]


def copy_down(job: LoadJob, tiers: list[KVTier], codec: BlockCodec) -> None:
    """Stores blocks a slower tier supplied in the faster tiers above it (Redis to disk), so the
    next hit is local."""
    for name, header, payload, tier in zip(job.names, job.headers, job.payloads, job.sources):
        for faster in tiers[: tiers.index(tier)]:
            faster.put(name, header, payload)


def _check(tier: KVTier, codec: BlockCodec, name: bytes, data: bytes | None) -> memoryview | None:
    if data is None:
        return None
    try:
        return codec.payload(name, data)
    except BlockError as exc:
        logger.warning("kv %s: block %s is unusable (%s): %s", tier.name, name.hex(), exc.kind, exc)
        tier.stats.add(exc.kind)
        tier.discard(name)
        return None


class Loader:
    """The loader threads: jobs run in arrival order, two at a time (a slow tier does not stall
    every lookup behind it)."""

    def __init__(self, run: Any, num_threads: int = 2) -> None:
        self._run_job = run
        self._jobs: list[LoadJob] = []
        self._cond = threading.Condition()
        self._closed = False
        self.finished = threading.Event()  # set whenever a job finishes; the loop naps on it
        self._threads = [
            threading.Thread(target=self._work, name=f"plait-kv-loader-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: LoadJob) -> None:
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._jobs.pop(0)
            try:
                if not job.abandoned:
                    self._run_job(job)
            except Exception:
                logger.exception("kv tiers: loading blocks failed")
                job.payloads.clear()
            finally:
                job.done = True
                self.finished.set()
