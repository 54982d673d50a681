"""Page tables of requests over the radix cache: match and lock, grow, cache, release.

Every page is in exactly one place: the allocator's free list, the radix tree (`cached`; locked
while a request reads it) or a request's own tail of pages (`in use`). Request `pages[:n]` with
`n = req.num_cached_pages` belong to the tree and are locked through `req.last_node`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from plait.radix_cache import PageAllocator, RadixCache
from plait.runtime.request import Request


class KVCacheManager:
    def __init__(self, allocator: PageAllocator, cache: RadixCache, page_size: int) -> None:
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        self.tiers: Any = None  # KVTiers: cached blocks are also stored below the pool

    def available_pages(self) -> int:
        return self.allocator.num_free + self.cache.evictable_size()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # admission ---------------------------------------------------------------------------

    @staticmethod
    def match_limit(req: Request) -> int:
        """How many leading tokens of the request may come from the cache."""
        limit = req.num_tokens - 1  # at least one token is computed, to get the next logits
        if req.logprob.return_logprob and not req.input_token_logprobs:
            limit = min(limit, req.logprob_start)  # prompt logprobs need their logits computed
        return max(limit, 0)

    def match(self, req: Request) -> int:
        """Points the request at its longest cached prefix and locks it; returns its token count."""
        result = self.cache.match_prefix(req.all_ids[: self.match_limit(req)])
        self.cache.lock(result.node)
        req.last_node = result.node
        req.pages = list(result.pages)
        req.pages_stale_from = 0
        req.num_cached_pages = len(result.pages)
        req.num_computed = result.num_tokens
        return result.num_tokens

    def unmatch(self, req: Request) -> None:
        """Undoes `match` for a request that was not admitted after all."""
        self.cache.unlock(req.last_node)
        req.last_node = None
        req.pages = []
        req.pages_stale_from = 0
        req.num_cached_pages = 0
        req.num_computed = 0

    # growth ------------------------------------------------------------------------------

    def allocate(self, num_pages: int) -> list[int] | None:
        """`num_pages` fresh pages, evicting cached ones if needed; None if impossible."""
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
            if self.allocator.num_free < num_pages:
                return None
        return self.allocator.allocate(num_pages)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Extends the page table to cover `num_tokens` positions; False when out of pages."""
        missing = self.pages_for(num_tokens) - len(req.pages)
        if missing <= 0:
            return True
        pages = self.allocate(missing)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def trim(self, req: Request) -> None:
        """Frees pages past the request's tokens (left over from rejected draft tokens)."""
        keep = max(self.pages_for(req.num_tokens), req.num_cached_pages)
        if len(req.pages) > keep:
            self._free(req.pages[keep:])
            del req.pages[keep:]
            req.pages_stale_from = min(req.pages_stale_from, keep)

    # caching and release ----------------------------------------------------------------

    def cache_prefix(self, req: Request) -> None:
        """Inserts the request's computed whole pages into the tree and re-locks at the new end."""
        if self.cache.disable:
            return
        full = req.num_computed // self.page_size
        if full <= req.num_cached_pages:
            return
        tokens = req.all_ids[: full * self.page_size]
        already = self.cache.insert(tokens, req.pages[:full]) // self.page_size
        self._free(req.pages[req.num_cached_pages : already])  # another request cached these first
        result = self.cache.match_prefix(tokens, record=False)
        self.cache.lock(result.node)
        self.cache.unlock(req.last_node)
        if self.tiers is not None:
            self.tiers.cached(result.node, result.pages, already * self.page_size, len(tokens))
        req.pages[:full] = result.pages
        req.pages_stale_from = 0  # once per request: not worth proving which pages kept their place
        req.num_cached_pages = full
        req.last_node = result.node

    def release(self, req: Request, keep: bool) -> None:
        """Gives back everything the request holds; with `keep`, its computed pages stay cached."""
        if req.last_node is None:
            self._free(req.pages)
        else:
            if keep:
                self.cache_prefix(req)
            self._free(req.pages[req.num_cached_pages :])
            self.cache.unlock(req.last_node)
        req.pages = []
        req.pages_stale_from = 0
        req.num_cached_pages = 0
        req.last_node = None
        req.num_computed = 0

    def _free(self, pages: list[int]) -> None:
        if pages:
            self.allocator.free(pages)

    # accounting --------------------------------------------------------------------------

    def num_in_use(self, reqs: Iterable[Request]) -> int:
        return sum(len(r.pages) - r.num_cached_pages for r in reqs)

    def check(self, reqs: Iterable[Request]) -> None:
        """Raises AssertionError unless free + cached + in use == pool size, with no page twice."""
        reqs = list(reqs)
        owned = [p for r in reqs for p in r.pages[r.num_cached_pages :]]
        total = self.allocator.num_free + self.cache.total_size() + len(owned)
        assert total == self.allocator.num_total, (
            f"page accounting: free {self.allocator.num_free} + cached {self.cache.total_size()} "
            f"+ in use {len(owned)} != pool {self.allocator.num_total}"
        )
        assert len(set(owned)) == len(owned), "page accounting: a page is owned twice"
        self.cache.check_integrity()
