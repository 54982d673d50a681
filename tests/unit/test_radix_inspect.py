"""`summarize_tree`: the largest branches, parents first, exact totals, and no side effects."""

from __future__ import annotations

import random
import threading

from plait.radix_cache import PageAllocator, RadixCache
from plait.radix_cache.inspect import summarize_tree


def _cache(page_size: int = 2) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(256)
    return RadixCache(page_size, alloc), alloc


def _insert(cache: RadixCache, alloc: PageAllocator, tokens: list[int]) -> None:
    pages = alloc.allocate(len(tokens) // cache.page_size)
    cached = cache.insert(tokens, pages) // cache.page_size
    alloc.free(pages[:cached])


def test_totals_and_largest_branches_first():
    cache, alloc = _cache()
    shared = list(range(100, 120))
    _insert(cache, alloc, shared + [1, 2, 3, 4])
    _insert(cache, alloc, shared + [5, 6])
    _insert(cache, alloc, [7, 8, 9, 10])
    m = cache.match_prefix(shared + [1, 2])
    cache.lock(m.node)
    tree = summarize_tree(cache)
    root, *rest = tree.nodes
    assert root.parent is None and root.subtree_tokens == 20 + 4 + 2 + 4 == tree.num_tokens
    assert tree.num_nodes == len(rest) == 5  # the shared edge was split at the locked match
    assert (
        tree.cached_pages == cache.total_size() and tree.protected_pages == cache.protected_size()
    )
    assert rest[0].subtree_tokens == 26 and rest[0].tokens == 20 and rest[0].locked
    shown = {n.id for n in tree.nodes}
    assert all(n.parent in shown for n in rest)  # each parent comes before its children
    assert sum(n.pages for n in tree.nodes) == tree.cached_pages
    assert {n.locked for n in rest if n.subtree_tokens == 4 and n.depth == 1} == {False}


def test_read_only_and_capped():
    cache, alloc = _cache(page_size=1)
    rng = random.Random(0)
    for _ in range(50):
        _insert(cache, alloc, [rng.randrange(6) for _ in range(rng.randrange(1, 12))])
    before = (cache.pretty_print(), cache.stats(), cache._clock)
    tree = summarize_tree(cache, max_nodes=7, hits={cache.root.id: 3}, key_tokens=2)
    assert (cache.pretty_print(), cache.stats(), cache._clock) == before
    cache.check_integrity()
    assert len(tree.nodes) == 8 and tree.num_nodes > 7
    sizes = [n.subtree_tokens for n in tree.nodes[1:]]
    assert max(sizes) == tree.nodes[1].subtree_tokens
    assert tree.nodes[0].hits == 3 and all(n.hits == 0 for n in tree.nodes[1:])
    assert all(1 <= len(n.key_head) <= 2 for n in tree.nodes[1:])


def test_walks_while_another_thread_changes_the_tree():
    cache, alloc = _cache(page_size=1)
    stop = threading.Event()

    def churn() -> None:
        rng = random.Random(1)
        while not stop.is_set():
            _insert(cache, alloc, [rng.randrange(8) for _ in range(rng.randrange(1, 10))])
            if alloc.num_free < 64:
                cache.evict(32)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(200):
            tree = summarize_tree(cache, max_nodes=16)
            assert tree.nodes[0].parent is None
    finally:
        stop.set()
        worker.join()
