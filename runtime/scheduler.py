"""Choosing what runs in each forward pass. Holds only Python state: requests, pages, counters.

Each step is one mixed batch: a budget of prefill (extend) tokens, taken first by prompts being
prefilled in chunks, then by newly admitted requests in policy order; plus one decode token for
every running request. Admission is optimistic: it counts free plus evictable pages and reserves
only a shrinking estimate (`new_token_ratio`) of running requests' future tokens. When decode
still runs short, unlocked cache is evicted, then the most recently admitted requests are
retracted (their computed pages go to the cache, they requeue first and resume later).

Requests of a batch whose forward pass raised are quarantined: each then runs alone (its own
batch, nothing else decoding) until its prompt and output so far are recomputed, so a failure
that follows one request fails only that request.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

from plait.radix_cache import PageAllocator, RadixCache, WindowPages
from plait.runtime.batch import ExtendEntry, ScheduleBatch
from plait.runtime.config import SchedulerConfig
from plait.runtime.events import EngineEvents, RequestRetracted
from plait.runtime.kv_cache_manager import KVCacheManager
from plait.runtime.request import Request, RequestStatus
from plait.runtime.schedule_policy import fair_order, order_waiting
from plait.runtime.tuning import (
    IN_BATCH_PREFIX_THRESHOLD,
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_RATIO_DECAY,
    REWIND_SLACK_TOKENS,
)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        cache: RadixCache,
        page_size: int,
        context_len: int,
        window: WindowPages | None = None,
        tiers: Any = None,
        events: EngineEvents | None = None,
    ) -> None:
        self.config = config
        self.events = events if events is not None else EngineEvents()
        self.kv = KVCacheManager(allocator, cache, page_size, window, REWIND_SLACK_TOKENS)
        # KVTiers: blocks below the pool, promoted while their requests wait (kv_tiers/)
        self.tiers = tiers
        self.kv.tiers = tiers
        self.page_size = page_size
        self.context_len = context_len
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not fully computed yet
        self.running: list[Request] = []  # decoding
        self.quarantined: deque[Request] = deque()  # after a failed batch: each runs alone next
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retracted = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.computed_tokens = 0  # tokens run through the model (prefill + decode)
        self._admissions = itertools.count()

    # admission -----------------------------------------------------------------------------

    def max_tokens(self, req: Request) -> int:
        """All tokens this request can ever hold KV for."""
        # NOTE: a healed request's output may begin with the healed token, besides its budget
        total = len(req.prompt_ids) + req.sampling.params.max_new_tokens + bool(req.healing.text)
        return max(min(total, self.context_len), len(req.prompt_ids))

    def check_fits_pool(self, req: Request) -> None:
        """A `ValueError` naming `max_new_tokens` when `req` could never hold its KV in the pool,
        however empty (checked as a request is built, and again as it is added)."""
        if self.kv.pages_for(self.max_tokens(req)) > self.kv.allocator.num_total:
            raise ValueError(
                f"max_new_tokens: the request needs KV for {self.max_tokens(req)} tokens but the "
                f"pool holds {self.kv.allocator.num_total * self.page_size} (max_total_tokens)"
            )

    def add(self, req: Request) -> None:
        self.check_fits_pool(req)
        self.waiting.append(req)
        if self.tiers is not None:
            self.tiers.lookup(req, self.kv.match_limit(req))

    def _future_pages(self, req: Request) -> int:
        remaining = self.max_tokens(req) - req.num_tokens
        return self.kv.pages_for(int(remaining * self.new_token_ratio))

    def _try_admit(self, req: Request, reserved: int) -> bool:
        cached = self.kv.match(req)
        needed = (
            self.kv.pages_for(req.num_tokens) - req.kv.num_cached_pages + self._future_pages(req)
        )
        # its first chunk's pages, each with a window page where the model has sliding layers
        first = min(req.num_tokens, req.kv.num_computed + self.config.chunked_prefill_size)
        window_needed = self.kv.pages_for(first) - len(req.kv.pages)
        if (
            needed + reserved > self.kv.available_pages()
            or window_needed > self.kv.available_window_pages()
        ):
            self.kv.unmatch(req)
            return False
        req.status = RequestStatus.RUNNING
        req.admit_order = next(self._admissions)
        if not req.output_ids:  # a retracted request's prompt was counted already
            req.cached_tokens = cached
            self.prompt_tokens += len(req.prompt_ids)
            self.cached_prompt_tokens += cached
        return True

    # one step --------------------------------------------------------------------------------

    def has_work(self) -> bool:
        # NOTE: a request a jump-forward finished after the step's bookkeeping stays in `running`,
        # its pages released, until the next `schedule` (`_settle`); it is no work
        return bool(self.waiting or self.prefilling or self.quarantined) or any(
            not r.finished for r in self.running
        )

    def schedule(self) -> ScheduleBatch:
        self._settle()
        batch = self._schedule()
        batch.others_waiting = bool(self.waiting or self.prefilling or self.quarantined)
        return batch

    def _settle(self) -> None:
        """Running requests that changed after the last step's bookkeeping (`after_step`): one a
        jump-forward finished leaves (its pages are released already); one whose tail a
        jump-forward retokenized computes it as an extend, like a prompt chunk, before it decodes
        again, or is retracted where its window pages are gone that far back (it is recomputed
        after a match)."""
        for req in [r for r in self.running if r.finished or r.kv.num_computed < r.num_tokens - 1]:
            if req.finished:
                self.running.remove(req)
            elif not self.kv.can_rewind(req, req.kv.num_computed):
                self.retract(req)
            else:
                self.running.remove(req)
                self.prefilling.append(req)

    def _schedule(self) -> ScheduleBatch:
        batch = ScheduleBatch()
        if self.quarantined:
            return self._schedule_suspect(batch)
        self._prepare_decodes(batch)
        budget = self.config.max_prefill_tokens
        for req in self.prefilling:
            if budget <= 0:
                break
            budget -= self._add_extend(batch, req, budget)
        if budget <= 0 or not self.waiting:
            return batch
        if self.tiers is not None:
            self.tiers.promote(self.kv)
        reserved = sum(self._future_pages(r) for r in self.running + self.prefilling)
        num_active = len(self.prefilling) + len(self.running)
        admitted: list[Request] = []
        ordered = order_waiting(self.config.schedule_policy, self.waiting, self.kv.cache)
        for req in fair_order(ordered, self.running + self.prefilling):
            if budget <= 0 or num_active >= self.config.max_running_requests:
                break
            if self._shares_uncached_prefix(req, admitted):
                continue
            if self.tiers is not None and self.tiers.holds(req):
                continue
            if not self._try_admit(req, reserved):
                break
            reserved += self._future_pages(req)
            num_active += 1
            admitted.append(req)
            self.prefilling.append(req)
            taken = self._add_extend(batch, req, budget)
            if taken == 0:
                break
            budget -= taken
        chosen = set(admitted)
        self.waiting = deque(r for r in self.waiting if r not in chosen)
        return batch

    def _schedule_suspect(self, batch: ScheduleBatch) -> ScheduleBatch:
        """The first quarantined request alone; it leaves quarantine when its tokens are computed,
        or at once when it cannot get pages (then it runs with the others)."""
        req = self.quarantined[0]
        if req.status is RequestStatus.WAITING:
            if not self._try_admit(req, reserved=0):
                self.quarantined.popleft()
                self.waiting.appendleft(req)
                return batch
            self.prefilling.append(req)
        if self._add_extend(batch, req, self.config.max_prefill_tokens) == 0:
            self.quarantined.popleft()
        return batch

    def quarantine(self, reqs: list[Request]) -> None:
        """Takes the requests of a failed batch out of the queues, dropping KV the failed pass may
        have half written, and queues them to run one at a time."""
        for req in reqs:
            for queue in (self.waiting, self.prefilling, self.running):
                _remove(queue, req)
            if req in self.quarantined:
                continue
            self.kv.release(req, keep=False)
            req.spec.draft_valid = 0
            req.status = RequestStatus.WAITING
            self.quarantined.append(req)

    def _shares_uncached_prefix(self, req: Request, admitted: list[Request]) -> bool:
        if self.kv.cache.disable or not admitted:
            return False
        ids = req.all_ids
        shared = max(_common_prefix_len(ids, other.all_ids) for other in admitted)
        if shared < IN_BATCH_PREFIX_THRESHOLD:
            return False
        cached = self.kv.cache.match_prefix(ids[:shared], record=False).num_tokens
        return shared - cached >= IN_BATCH_PREFIX_THRESHOLD

    def _add_extend(self, batch: ScheduleBatch, req: Request, budget: int) -> int:
        start = req.kv.num_computed
        end = min(req.num_tokens, start + budget, start + self.config.chunked_prefill_size)
        if not self.kv.grow(req, end):
            return 0  # waits for pages; decode of others frees them or retraction does
        batch.extends.append(ExtendEntry(req, start, end, end == req.num_tokens))
        return end - start

    def _prepare_decodes(self, batch: ScheduleBatch) -> None:
        """Gives every running request a page for its next token, retracting others if needed."""
        self.running.sort(key=lambda r: r.admit_order)
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self.kv.grow(req, req.num_tokens):
                i += 1
                continue
            # NOTE: the newest request goes first, possibly `req` itself; since `running` is
            # sorted by admission, the victim is never one already grown at an index below i.
            victim = max(self.running + self.prefilling, key=lambda r: r.admit_order)
            if victim is req and len(self.running) + len(self.prefilling) == 1:
                raise RuntimeError(
                    f"request {req.rid} cannot grow although it runs alone; the pool is too small"
                )
            self.retract(victim)
        self.new_token_ratio = max(
            self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO
        )
        # NOTE: a request whose closing is being looked for off the loop waits (closing_jobs.py)
        batch.decodes.extend(r for r in self.running if r.closing.job is None)

    def retract(self, req: Request) -> None:
        """Frees a running request's pages (caching what it computed) and requeues it first."""
        if self.events.wants(RequestRetracted):
            self.events.emit(
                RequestRetracted(time.perf_counter(), req.rid, req.num_tokens, len(req.kv.pages))
            )
        if req in self.running:
            self.running.remove(req)
        else:
            self.prefilling.remove(req)
        self.kv.release(req, keep=True)
        req.spec.draft_valid = 0  # its pages change; a draft model's KV must be recomputed
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_retracted += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def after_step(self, batch: ScheduleBatch, decode_steps: int = 1) -> None:
        """Records computed KV (the decodes ran `decode_steps` steps), caches finished chunks,
        moves prefilled requests to decode, and releases finished ones."""
        self.computed_tokens += batch.computed_tokens(decode_steps)
        for e in batch.extends:
            e.req.kv.num_computed = e.end
            self.kv.slide(e.req)
        for v in batch.verifies:  # KV is valid for the last real token and the accepted drafts
            v.req.kv.num_computed = min(v.end + v.num_accepted, v.req.num_tokens)
            self.kv.trim(v.req)
            self.kv.slide(v.req)
        for req in batch.decodes:
            req.kv.num_computed = req.num_tokens - 1
            self.kv.trim(req)  # pages a burst grew past the tokens it kept
            self.kv.slide(req)
        still: list[Request] = []
        for e in batch.extends:
            req = e.req
            alone = self.quarantined and req is self.quarantined[0]
            if alone and (e.is_last_chunk or req.finished):
                self.quarantined.popleft()  # it ran alone without failing: back with the others
            if req.finished or req not in self.prefilling:
                continue
            self.kv.cache_prefix(req)  # later requests share the prompt while this one decodes
            if e.is_last_chunk:
                self.prefilling.remove(req)
                self.running.append(req)
        for req in self.prefilling:
            if req.finished:
                self.kv.release(req, keep=True)
            else:
                still.append(req)
        self.prefilling = still
        alive = []
        for req in self.running:
            if req.finished:
                self.kv.release(req, keep=True)
            else:
                alive.append(req)
        self.running = alive

    # leaving ---------------------------------------------------------------------------------

    def abort(self, rid: str, keep: bool = True) -> Request | None:
        queues = (self.waiting, self.prefilling, self.running, self.quarantined)
        found = next((r for q in queues for r in q if r.rid == rid), None)
        if found is not None:
            for queue in queues:
                _remove(queue, found)
            self.kv.release(found, keep=keep)
        return found

    def all_requests(self) -> list[Request]:
        seen = [*self.waiting, *self.prefilling, *self.running]
        return seen + [r for r in self.quarantined if r.status is RequestStatus.WAITING]

    def requests_by_state(self) -> list[tuple[str, Request]]:
        """Each request it holds, once, with its state: "decode", "prefill", "waiting",
        "retracted" (waiting with output already) or "quarantined". Readable from another thread:
        each queue is copied, again if the loop changed it meanwhile."""
        seen: set[Request] = set()
        out: list[tuple[str, Request]] = []
        for state, queue in (
            ("decode", self.running),
            ("prefill", self.prefilling),
            ("waiting", self.waiting),
            ("quarantined", self.quarantined),
        ):
            for req in _copy(queue):
                if req in seen or req.finished:
                    continue
                seen.add(req)
                out.append(("retracted" if state == "waiting" and req.output_ids else state, req))
        return out

    def check(self) -> None:
        self.kv.check(self.prefilling + self.running)


def _copy(queue: list[Request] | deque[Request]) -> list[Request]:
    for _ in range(3):
        try:
            return list(queue)
        except RuntimeError:  # a deque the loop changed while it was read
            continue
    return []


def _remove(queue: list[Request] | deque[Request], req: Request) -> None:
    for i, other in enumerate(queue):
        if other is req:
            del queue[i]
            return


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
