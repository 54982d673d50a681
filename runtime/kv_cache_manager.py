"""Page tables of requests over the radix cache: match and lock, grow, cache, release.

Every page is in exactly one place: the allocator's free list, the radix tree (`cached`; locked
while a request reads it) or a request's own tail of pages (`in use`). Request `pages[:n]` with
`n = req.kv.num_cached_pages` belong to the tree and are locked through `req.kv.last_node`.

A model with sliding-window layers also has `window` (`WindowPages`): each of a request's pages
from `req.kv.window_from` on has a window page for those layers (the tree's ones locked for the
request); as the request moves on, the pages its window no longer reaches give theirs back
(`slide`), so the sliding layers hold only about `window` tokens per request. A cached prefix
is reused only as far as the window of its next token still has its window pages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from plait.radix_cache import PageAllocator, RadixCache, WindowPages
from plait.runtime.request import Request


class KVCacheManager:
    def __init__(
        self,
        allocator: PageAllocator,
        cache: RadixCache,
        page_size: int,
        window: WindowPages | None = None,
        slack: int = 0,
    ) -> None:
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        self.window = window
        # NOTE: window pages are released `slack` tokens late: a jump-forward that retokenizes
        # a request's tail recomputes that far back (`rewind`), and needs them there.
        self.slack = slack
        self.tiers: Any = None  # KVTiers: cached blocks are also stored below the pool

    def available_pages(self) -> int:
        return self.allocator.num_free + self.cache.evictable_size()

    def available_window_pages(self) -> int:
        return self.window.available() if self.window is not None else self.available_pages()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # admission ---------------------------------------------------------------------------

    @staticmethod
    def match_limit(req: Request) -> int:
        """How many leading tokens of the request may come from the cache."""
        limit = req.num_tokens - 1  # at least one token is computed, to get the next logits
        if req.sampling.logprob.return_logprob and not req.input_token_logprobs:
            limit = min(limit, req.logprob_start)  # prompt logprobs need their logits computed
        return max(limit, 0)

    def match(self, req: Request) -> int:
        """Points the request at its longest cached prefix and locks it; returns its token count."""
        tokens = req.all_ids[: self.match_limit(req)]
        if self.window is None:
            result = self.cache.match_prefix(tokens)
        else:
            result = self.cache.match_prefix(tokens, usable=self.window.usable)
        self.cache.lock(result.node)
        req.kv.last_node = result.node
        req.kv.pages = list(result.pages)
        req.kv.pages_stale_from = 0
        req.kv.num_cached_pages = req.kv.matched_pages = len(result.pages)
        req.kv.num_computed = result.num_tokens
        if self.window is not None:
            req.kv.window_from = self.window.first_needed(result.num_tokens)
            self.window.lock(req.kv.pages[req.kv.window_from :])
        return result.num_tokens

    def unmatch(self, req: Request) -> None:
        """Undoes `match` for a request that was not admitted after all."""
        if self.window is not None:
            self.window.unlock(req.kv.pages[req.kv.window_from :])
        self.cache.unlock(req.kv.last_node)
        req.kv.last_node = None
        req.kv.pages = []
        req.kv.pages_stale_from = 0
        req.kv.num_cached_pages = req.kv.matched_pages = 0
        req.kv.num_computed = 0
        req.kv.window_from = 0

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
        """Extends the page table to cover `num_tokens` positions (each new page with its window
        page, where the model has sliding layers); False when out of pages."""
        missing = self.pages_for(num_tokens) - len(req.kv.pages)
        if missing <= 0:
            return True
        pages = self.allocate(missing)
        if pages is None:
            return False
        if self.window is not None and not self.window.attach(pages):
            self.allocator.free(pages)
            return False
        req.kv.pages.extend(pages)
        return True

    def slide(self, req: Request) -> None:
        """Releases, for the sliding layers, the pages the request's window has left behind.
        Window pages the request made go back at once (also those it has cached meanwhile,
        unless another request still reads them), but for the window before its prompt's end;
        those and the ones of the prefix it found cached are only unlocked: they stay with the
        tree, which is asked for the same prompt again (another `select` choice, a program's
        next call), until their window pages are needed elsewhere."""
        kv = req.kv
        if self.window is None or kv.last_node is None:
            return
        end = min(self.window.first_needed(kv.num_computed - self.slack), len(kv.pages))
        if end <= kv.window_from:
            return
        cached = kv.num_cached_pages
        prompt = len(req.prompt_ids)
        tail = range(self.window.first_needed(prompt - self.page_size), self.pages_for(prompt))
        passed = range(kv.window_from, min(end, cached))
        self.window.unlock(kv.pages[i] for i in passed)
        self.window.detach(
            kv.pages[i]
            for i in passed
            if i >= kv.matched_pages and i not in tail and not self.window.locks[kv.pages[i]]
        )
        self.window.detach(kv.pages[max(kv.window_from, cached) : end])
        kv.window_from = end

    def rewind(self, req: Request, num_valid: int) -> None:
        """The request's tokens after `num_valid` changed (a jump-forward retokenized its tail):
        their KV is stale. A finished request gives its pages back at once, caching the valid
        prefix; a running one recomputes the tail before it decodes again (`Scheduler.schedule`)."""
        req.kv.num_computed = min(req.kv.num_computed, num_valid)
        if req.finished:
            self.release(req, keep=True)

    def can_rewind(self, req: Request, position: int) -> bool:
        """Whether the request still has the window pages to recompute from `position` on."""
        return self.window is None or self.window.first_needed(position) >= req.kv.window_from

    def trim(self, req: Request) -> None:
        """Frees pages past the request's tokens (left over from rejected draft tokens)."""
        keep = max(self.pages_for(req.num_tokens), req.kv.num_cached_pages)
        if len(req.kv.pages) > keep:
            self._free(req.kv.pages[keep:])
            del req.kv.pages[keep:]
            req.kv.pages_stale_from = min(req.kv.pages_stale_from, keep)

    # caching and release ----------------------------------------------------------------

    def cache_prefix(self, req: Request) -> None:
        """Inserts the request's computed whole pages into the tree and re-locks at the new end."""
        if self.cache.disable:
            return
        full = req.kv.num_computed // self.page_size
        if full <= req.kv.num_cached_pages:
            return
        tokens = req.all_ids[: full * self.page_size]
        already = self.cache.insert(tokens, req.kv.pages[:full]) // self.page_size
        result = self.cache.match_prefix(tokens, record=False)
        start = req.kv.num_cached_pages
        if self.window is not None:
            # where another request cached these tokens first, the tree's pages take ours' place;
            # one that lost its window page takes ours (the same positions' KV)
            for i in range(max(start, req.kv.window_from), already):
                if self.window.of[result.pages[i]] < 0:
                    self.window.move(req.kv.pages[i], result.pages[i])
            self.window.lock(result.pages[max(start, req.kv.window_from) : full])
        self._free(req.kv.pages[start:already])  # another request cached these first
        self.cache.lock(result.node)
        self.cache.unlock(req.kv.last_node)
        if self.tiers is not None:
            self.tiers.cached(result.node, result.pages, already * self.page_size, len(tokens))
        req.kv.pages[:full] = result.pages
        # once per request: not worth proving which pages kept their place
        req.kv.pages_stale_from = 0
        req.kv.num_cached_pages = full
        req.kv.last_node = result.node

    def release(self, req: Request, keep: bool) -> None:
        """Gives back everything the request holds; with `keep`, its computed pages stay cached."""
        if req.kv.last_node is None:
            self._free(req.kv.pages)
        else:
            if keep:
                self.cache_prefix(req)
            if self.window is not None:
                self.window.unlock(req.kv.pages[req.kv.window_from : req.kv.num_cached_pages])
            self._free(req.kv.pages[req.kv.num_cached_pages :])
            self.cache.unlock(req.kv.last_node)
        req.kv.pages = []
        req.kv.pages_stale_from = 0
        req.kv.num_cached_pages = req.kv.matched_pages = 0
        req.kv.last_node = None
        req.kv.num_computed = 0
        req.kv.window_from = 0

    def _free(self, pages: list[int]) -> None:
        if pages:
            self.allocator.free(pages)  # their window pages go too (`WindowPages.logical_freed`)

    # accounting --------------------------------------------------------------------------

    def check(self, reqs: Iterable[Request]) -> None:
        """Raises AssertionError unless free + cached + in use == pool size, with no page twice
        (and, for the sliding layers, every window page free or held once, as `WindowPages`
        says, each request's pages from `window_from` on holding theirs)."""
        reqs = list(reqs)
        owned = [p for r in reqs for p in r.kv.pages[r.kv.num_cached_pages :]]
        total = self.allocator.num_free + self.cache.total_size() + len(owned)
        assert total == self.allocator.num_total, (
            f"page accounting: free {self.allocator.num_free} + cached {self.cache.total_size()} "
            f"+ in use {len(owned)} != pool {self.allocator.num_total}"
        )
        assert len(set(owned)) == len(owned), "page accounting: a page is owned twice"
        self.cache.check_integrity()
        if self.window is None:
            return
        for r in reqs:
            own_released = r.kv.pages[r.kv.num_cached_pages : r.kv.window_from]
            assert all(self.window.of[p] >= 0 for p in r.kv.pages[r.kv.window_from :]), (
                f"request {r.rid}: a page after window_from {r.kv.window_from} has no window page"
            )
            assert all(self.window.of[p] < 0 for p in own_released), (
                f"request {r.rid}: an own page before window_from {r.kv.window_from} kept its "
                "window page"
            )
        locks = Counter(
            p for r in reqs for p in r.kv.pages[r.kv.window_from : r.kv.num_cached_pages]
        )
        self.window.check(set(self.cache.pages()), dict(locks))
