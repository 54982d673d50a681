"""Choosing what runs in each forward pass. Holds only Python state: requests, pages, counters.

Each step is one mixed batch: a budget of prefill (extend) tokens, taken first by a prompt that is
being prefilled in chunks, then by newly admitted requests; plus one decode token for every
running request. A request is admitted only when its prompt pages and the pages its remaining
output can need are available, so decode never runs out of pages.
"""

from __future__ import annotations

from collections import deque

from plait.radix_cache.allocator import PageAllocator
from plait.runtime.config import SchedulerConfig
from plait.runtime.model_runner import ExtendEntry, ScheduleBatch
from plait.runtime.request import Request, RequestStatus


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        page_size: int,
        context_len: int,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.context_len = context_len
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not fully computed yet
        self.running: list[Request] = []  # decoding
        self.reserved: dict[str, int] = {}  # rid -> pages still to be allocated for its output

    # admission -------------------------------------------------------------------------------

    def max_tokens(self, req: Request) -> int:
        """All tokens this request can ever hold KV for."""
        limit = min(len(req.prompt_ids) + req.params.max_new_tokens, self.context_len)
        return max(limit, len(req.prompt_ids))

    def pages_needed(self, req: Request) -> int:
        return ceil_div(self.max_tokens(req), self.page_size)

    def fits_pool(self, req: Request) -> bool:
        return self.pages_needed(req) <= self.allocator.num_total

    def add(self, req: Request) -> None:
        if not self.fits_pool(req):
            raise ValueError(
                f"request needs KV for {self.max_tokens(req)} tokens but the pool holds "
                f"{self.allocator.num_total * self.page_size} (raise max_total_tokens or lower "
                f"max_new_tokens)"
            )
        self.waiting.append(req)

    @property
    def num_reserved(self) -> int:
        return sum(self.reserved.values())

    def _admit(self, req: Request) -> bool:
        needed = self.pages_needed(req)
        if self.allocator.num_free - self.num_reserved < needed:
            return False
        prompt_pages = ceil_div(req.num_tokens, self.page_size)
        req.pages = self.allocator.allocate(prompt_pages)
        self.reserved[req.rid] = needed - prompt_pages
        req.num_computed = 0
        req.status = RequestStatus.RUNNING
        return True

    # one step --------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def schedule(self) -> ScheduleBatch:
        batch = ScheduleBatch()
        budget = self.config.max_prefill_tokens
        chunk = self.config.chunked_prefill_size
        for req in self.prefilling:
            if budget <= 0:
                break
            budget -= self._add_extend(batch, req, min(budget, chunk))
        num_active = len(self.prefilling) + len(self.running)
        while self.waiting and budget > 0 and num_active < self.config.max_running_requests:
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.prefilling.append(req)
            num_active += 1
            budget -= self._add_extend(batch, req, min(budget, chunk))
        for req in self.running:
            self._grow(req, req.num_tokens)
            batch.decodes.append(req)
        return batch

    def _add_extend(self, batch: ScheduleBatch, req: Request, max_len: int) -> int:
        start = req.num_computed
        end = min(req.num_tokens, start + max_len)
        batch.extends.append(ExtendEntry(req, start, end, end == req.num_tokens))
        return end - start

    def _grow(self, req: Request, num_tokens: int) -> None:
        """Makes sure the page table covers `num_tokens` positions, drawing on the reservation."""
        missing = ceil_div(num_tokens, self.page_size) - len(req.pages)
        if missing > 0:
            req.pages.extend(self.allocator.allocate(missing))
            self.reserved[req.rid] -= missing

    def after_step(self, batch: ScheduleBatch) -> None:
        """Moves requests whose prompt is fully computed into decode; drops finished ones."""
        done_prefill: set[str] = set()
        for e in batch.extends:
            e.req.num_computed = e.end
            if e.is_last_chunk:
                done_prefill.add(e.req.rid)
        for req in batch.decodes:
            req.num_computed = req.num_tokens - 1
        still: list[Request] = []
        for req in self.prefilling:
            if req.finished:
                self.release(req)
            elif req.rid in done_prefill:
                self.running.append(req)
            else:
                still.append(req)
        self.prefilling = still
        alive = []
        for req in self.running:
            if req.finished:
                self.release(req)
            else:
                alive.append(req)
        self.running = alive

    # leaving ---------------------------------------------------------------------------------

    def release(self, req: Request) -> None:
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        self.reserved.pop(req.rid, None)

    def abort(self, rid: str) -> Request | None:
        for queue in (self.waiting, self.prefilling, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self.release(req)
                    return req
        return None

    def all_requests(self) -> list[Request]:
        return [*self.waiting, *self.prefilling, *self.running]
