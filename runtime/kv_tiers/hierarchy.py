"""`KVTiers`: the tiers below the pool (local disk, Redis) as the scheduler sees them.

- **Demotion** (`cached`): when a request's pages enter the radix cache, each block they complete
  is snapshotted and stored below by the writer thread; evicting it from the pool later loses
  nothing, and a restarted engine finds it.
- **Promotion** (`lookup`, `holds`, `promote`): when a request arrives whose prompt goes past what
  the pool caches, loader threads look for its next blocks below while it waits in the queue. The
  loop copies what they found into fresh pages and caches them, and the request is admitted with
  them as cached prefix. It waits at most as long as prefilling those tokens would take; then
  it prefills, and a late load is dropped.

Every failure of a tier is a miss (see `KVTier`). Called only from the engine loop, except where
a method says otherwise; holds no tensors (`PoolBlockIO` copies them).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from plait.radix_cache import RadixCache, chain_names
from plait.runtime.kv_tiers.block_format import BlockCodec
from plait.runtime.kv_tiers.loader import Loader, LoadJob, copy_down, load
from plait.runtime.kv_tiers.pool_io import PoolBlockIO
from plait.runtime.kv_tiers.tier import KVTier
from plait.runtime.kv_tiers.writer import BlockWriter
from plait.runtime.request import Request, RequestStatus
from plait.runtime.tuning import (
    TIER_ASSUMED_PREFILL_TOKENS_PER_S,
    TIER_FLUSH_SECONDS,
    TIER_MIN_HOLD_SECONDS,
)

logger = logging.getLogger("plait.kv_tiers")

_PREFILL_RATE_WEIGHT = 0.2  # of the newest step, in the moving average of prefill tokens/s


class KVTiers:
    def __init__(
        self, tiers: list[KVTier], io: PoolBlockIO, codec: BlockCodec, cache: RadixCache
    ) -> None:
        if cache.root_name is None:
            raise ValueError("KVTiers: the radix cache must name its pages (a salt)")
        self.tiers = tiers
        self.io = io
        self.codec = codec
        self.cache = cache
        self.page_size = cache.page_size
        self.block_pages = io.layout.block_pages
        self.block_tokens = io.layout.block_tokens
        self.writer = BlockWriter(tiers, io, codec)
        self.loader = Loader(self._load)
        self._jobs: dict[Request, LoadJob] = {}  # by request, while it is held
        self._finished: list[LoadJob] = []
        self.prefill_rate: float | None = None  # measured tokens/s
        self.totals = {"promoted_tokens": 0, "late_loads": 0, "held_requests": 0, "no_room": 0}

    # promotion ------------------------------------------------------------------------------

    def lookup(self, req: Request, limit: int) -> None:
        """Starts looking below the pool for the whole blocks of `req.all_ids[:limit]` that the
        pool does not cache."""
        end = limit - limit % self.block_tokens
        if end <= 0:
            return
        tokens = req.all_ids[:end]
        cached = self.cache.match_prefix(tokens, record=False).num_tokens
        if cached >= end:
            return
        first = cached // self.block_tokens
        wait = self.prefill_seconds(end - first * self.block_tokens)
        job = LoadJob(req, tokens, first, deadline=time.perf_counter() + wait)
        self._jobs[req] = job
        self.totals["held_requests"] += 1
        self.loader.submit(job)

    def holds(self, req: Request) -> bool:
        """Whether `req` waits for its blocks (until they are loaded, or its wait is over)."""
        job = self._jobs.get(req)
        if job is None:
            return False
        if job.done:
            return True  # `promote` takes it at the next step
        if time.perf_counter() < job.deadline:
            return True
        job.abandoned = True
        del self._jobs[req]
        tier = job.tier
        if tier is not None:
            tier.stats.add("timeout")
            logger.warning(
                "kv %s: a lookup outlasted the prefill it would save; prefilling", tier.name
            )
        self.totals["late_loads"] += 1
        return False

    def promote(self, kv: Any) -> None:
        """Copies the blocks loaded for waiting requests into fresh pages and caches them
        (`kv`: the scheduler's KVCacheManager, which finds the pages)."""
        if not self._jobs:
            return
        for key, job in list(self._jobs.items()):
            if not job.done:
                continue
            del self._jobs[key]
            if job.req.status is RequestStatus.WAITING and job.payloads:
                self._apply(job, kv)

    def wait(self, timeout: float) -> None:
        """Naps until a load finishes, a held request's wait is over, or `timeout` seconds."""
        if not self._jobs:
            return
        deadline = min(job.deadline for job in self._jobs.values())
        nap = min(timeout, max(deadline - time.perf_counter(), 0.0))
        if nap > 0 and not any(job.done for job in self._jobs.values()):
            self.loader.finished.wait(nap)
        self.loader.finished.clear()

    def _load(self, job: LoadJob) -> None:  # on a loader thread
        load(job, self.tiers, self.codec, self.cache.root_name, self.page_size)  # type: ignore[arg-type]
        if len(self.tiers) > 1 and job.payloads:
            job.done = True  # the request need not wait for the copy to the faster tiers
            self.loader.finished.set()
            copy_down(job, self.tiers, self.codec)

    def _apply(self, job: LoadJob, kv: Any) -> None:
        bt, ps = self.block_tokens, self.page_size
        end = (job.first_block + len(job.payloads)) * bt
        match = self.cache.match_prefix(job.tokens[:end], record=False)
        start = match.num_tokens
        if start >= end or start < job.first_block * bt:
            return  # cached meanwhile, or evicted below the first loaded block
        self.cache.lock(match.node)
        try:
            pages = kv.allocate((end - start) // ps)
            if pages is None:
                self.totals["no_room"] += 1
                return
            pos = start
            for i, payload in enumerate(job.payloads):
                block_start = (job.first_block + i) * bt
                if block_start + bt <= pos:
                    continue
                first = (pos - block_start) // ps
                taken = pages[(pos - start) // ps : (block_start + bt - start) // ps]
                self.io.scatter(payload, first, taken)
                job.sources[i].stats.add("promotions")
                pos = block_start + bt
            self.cache.insert(job.tokens[:end], match.pages + pages)
            self.totals["promoted_tokens"] += end - start
        finally:
            self.cache.unlock(match.node)

    # demotion -------------------------------------------------------------------------------

    def cached(self, node: Any, pages: list[int], already: int, end: int) -> None:
        """A request's tokens `[already, end)` entered the radix cache (`node`: the deepest node
        of the prefix, `pages`: its pages from the first): stores the blocks they complete."""
        bt, ps = self.block_tokens, self.page_size
        ends = range((already // bt + 1) * bt, end + 1, bt)
        if not ends or not self.writer.has_room():
            return
        names = self.cache.path_names(node)
        block_pages = [p for e in ends for p in pages[(e - bt) // ps : e // ps]]
        self.writer.submit([names[e // ps - 1] for e in ends], self.io.gather(block_pages))

    def block_names(self, tokens: list[int]) -> list[bytes]:
        """The names the whole blocks of `tokens` are stored under, in every tier."""
        names = chain_names(self.cache.root_name, tokens, self.page_size)  # type: ignore[arg-type]
        return names[self.block_pages - 1 :: self.block_pages]

    # timing ---------------------------------------------------------------------------------

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        old = self.prefill_rate
        self.prefill_rate = rate if old is None else old + _PREFILL_RATE_WEIGHT * (rate - old)

    def prefill_seconds(self, num_tokens: int) -> float:
        rate = self.prefill_rate or TIER_ASSUMED_PREFILL_TOKENS_PER_S
        return max(num_tokens / rate, TIER_MIN_HOLD_SECONDS)

    # introspection and shutdown ---------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kv_tiers": ",".join(t.name for t in self.tiers)}
        for tier in self.tiers:
            blocks, nbytes = tier.usage()
            out[f"kv_{tier.name}_blocks"] = blocks
            out[f"kv_{tier.name}_bytes"] = nbytes
            out.update({f"kv_{tier.name}_{k}": v for k, v in tier.stats.snapshot().items()})
        out.update({f"kv_tiers_{k}": v for k, v in self.totals.items()})
        out["kv_tiers_pending_write_bytes"] = self.writer.pending_bytes
        out["kv_tiers_dropped_blocks"] = self.writer.dropped_blocks
        out["kv_tiers_block_tokens"] = self.block_tokens
        return out

    def close(self) -> None:
        """Stores what the writer holds (bounded by `TIER_FLUSH_SECONDS`), then lets go."""
        self.loader.close()
        if not self.writer.close(TIER_FLUSH_SECONDS):
            logger.warning("kv tiers: blocks still being written at shutdown were dropped")
        for tier in self.tiers:
            tier.close()
