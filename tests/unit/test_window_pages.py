"""The sliding layers' window pages: which cached prefixes stay usable, eviction and locks, and a
scheduler driven through random traffic against a model of what every KV slot holds."""

from __future__ import annotations

import random

import pytest

from plait.radix_cache import PageAllocator, RadixCache, WindowPages
from plait.runtime.config import SchedulerConfig
from plait.runtime.protocol import SamplingParams
from plait.runtime.request import Request, RequestStatus, SamplingState
from plait.runtime.scheduler import Scheduler


def test_a_prefix_is_usable_as_far_as_its_next_window_has_its_pages():
    window = WindowPages(num_logical=8, num_pages=8, window=5, page_size=2)
    assert window.attach([0, 1, 2, 3, 4])
    pages = [0, 1, 2, 3, 4]
    assert window.usable(pages) == 5
    window.detach([0])  # the first page: no query after position 5 reads it any more
    assert window.usable(pages) == 5
    window.detach([3])  # inside the window of the queries at 8 and 10, not of the one at 6
    assert window.usable(pages) == 3  # a query at 6 reads positions 2-5: pages 1 and 2
    window.detach([1])
    assert window.usable(pages) == 0  # at 6, 4 and 2, the query's window reaches a page without
    assert window.usable([2]) == 1


def test_eviction_takes_unlocked_tree_pages_first_unlocked_first():
    allocator = PageAllocator(6)
    window = WindowPages(num_logical=6, num_pages=3, window=4, page_size=1)
    allocator.on_free = window.logical_freed
    pages = allocator.allocate(3)
    assert window.attach(pages)
    window.lock(pages)
    assert window.available() == 0 and not window.attach(allocator.allocate(1))
    window.unlock([pages[2]])
    window.unlock([pages[0]])
    fresh = allocator.allocate(2)
    assert window.attach(fresh[:1])  # evicts pages[2], unlocked first
    assert window.of[pages[2]] < 0 and window.of[pages[0]] >= 0
    assert not window.attach(fresh[1:]) or window.of[pages[0]] < 0
    window.lock([pages[1]])  # never evicted while locked
    assert window.evict(3) == 0 and window.of[pages[1]] >= 0
    allocator.free([pages[1]])  # a freed logical page takes its window page with it
    assert window.of[pages[1]] < 0


def test_check_names_a_broken_lock():
    window = WindowPages(num_logical=4, num_pages=4, window=2, page_size=1)
    window.attach([0, 1])
    window.lock([0])
    window.check(tree_pages={0}, expected_locks={0: 1})  # page 1: a request's own
    with pytest.raises(AssertionError, match="window locks"):
        window.check(tree_pages={0}, expected_locks={})


class SlotModel:
    """What each KV slot holds, as (token, position): the pool's slots for the full layers, the
    window slots for the sliding ones. Every read must find what the query's context wrote."""

    def __init__(self, window: WindowPages, page_size: int) -> None:
        self.window = window
        self.page_size = page_size
        self.full: dict[int, tuple[int, int]] = {}
        self.windowed: dict[int, tuple[int, int]] = {}

    def slots(self, req: Request, position: int) -> tuple[int, int]:
        page, offset = divmod(position, self.page_size)
        logical = req.kv.pages[page]
        return logical * self.page_size + offset, self.window.of[logical] * self.page_size + offset

    def run(self, req: Request, start: int, end: int) -> None:
        ids = req.all_ids
        for p in range(start, end):
            full, windowed = self.slots(req, p)
            assert windowed >= 0, f"{req.rid}: position {p} is written without a window page"
            self.full[full] = self.windowed[windowed] = (ids[p], p)
        for q in range(start, end):  # each query's context, in both kinds of layers
            for p in range(q + 1):
                full, windowed = self.slots(req, p)
                assert self.full.get(full) == (ids[p], p), f"{req.rid}: full KV at {p}"
                if p > q - self.window.window:
                    assert windowed >= 0 and self.windowed.get(windowed) == (ids[p], p), (
                        f"{req.rid}: window KV at {p} for the query at {q}"
                    )


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_every_window_read_right(seed):
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4])
    window_tokens = rng.choice([3, 8, 13])
    num_pages = 400 // page_size
    # room for two requests' windows, slack and chunks: fewer would retract, more never evicts
    window = WindowPages(num_pages, rng.choice([120, 160]) // page_size, window_tokens, page_size)
    allocator = PageAllocator(num_pages)
    allocator.on_free = window.logical_freed
    cache = RadixCache(page_size, allocator)
    config = SchedulerConfig(max_running_requests=4, max_prefill_tokens=24, chunked_prefill_size=7)
    scheduler = Scheduler(config, allocator, cache, page_size, context_len=200, window=window)
    slots = SlotModel(window, page_size)
    stems = [[rng.randrange(100) for _ in range(60)] for _ in range(3)]
    budgets: dict[str, int] = {}
    for step in range(300):
        if rng.random() < 0.3 and len(budgets) < 8:
            rid = f"r{step}"
            prompt = rng.choice(stems)[: rng.randrange(1, 60)] + [rng.randrange(100)]
            scheduler.add(Request(rid, prompt, SamplingState(SamplingParams(max_new_tokens=40))))
            budgets[rid] = rng.randrange(1, 40)
        batch = scheduler.schedule()
        for e in batch.extends:
            slots.run(e.req, e.start, e.end)
        for req in batch.decodes:
            slots.run(req, req.num_tokens - 1, req.num_tokens)
        samplers = [e.req for e in batch.extends if e.is_last_chunk] + batch.decodes
        for req in samplers:
            req.output_ids.append(rng.randrange(100))
            if len(req.output_ids) >= budgets[req.rid]:
                req.status = RequestStatus.FINISHED
                del budgets[req.rid]
        scheduler.after_step(batch)
        scheduler.check()
    assert window.num_attached <= window.num_pages
