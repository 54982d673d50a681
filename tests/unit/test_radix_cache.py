from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from plait.radix_cache import MatchResult, PageAllocator, RadixCache, TreeNode

DOC = Path(__file__).resolve().parents[2] / "docs" / "radix_cache.md"


def cached_prefixes(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached page-aligned prefix mapped to the page of its last page."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for i, page in enumerate(node.value):
            out[path + tuple(node.key[: (i + 1) * cache.page_size])] = page
        for child in node.children.values():
            stack.append((child, path + tuple(node.key)))
    return out


def seq(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# page_size 1


def test_insert_then_match_splits_inside_an_edge() -> None:
    cache = RadixCache(page_size=1)
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    result = cache.match_prefix([1, 2, 3, 9])
    assert (result.pages, result.num_tokens) == ([10, 11, 12], 3)
    assert result.node.key == [1, 2, 3]
    assert [c.key for c in result.node.children.values()] == [[4]]
    assert cache.total_size() == 4
    cache.check_integrity()


def test_insert_returns_tokens_already_cached() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert cache.insert([1, 2, 3, 5, 6], [20, 21, 22, 23, 24]) == 3
    assert cache.insert([1, 2], [30, 31]) == 2
    assert cache.insert([7], [40]) == 0
    assert cached_prefixes(cache) == {
        (1,): 10,
        (1, 2): 11,
        (1, 2, 3): 12,
        (1, 2, 3, 4): 13,
        (1, 2, 3, 5): 23,
        (1, 2, 3, 5, 6): 24,
        (7,): 40,
    }
    assert cache.total_size() == 7
    cache.check_integrity()


def test_match_on_empty_cache_and_empty_query() -> None:
    cache = RadixCache(page_size=1)
    assert cache.match_prefix([]) == MatchResult([], cache.root, 0)
    assert cache.match_prefix([5, 6]).node is cache.root
    cache.insert([5, 6], [0, 1])
    result = cache.match_prefix((5, 6, 7))
    assert (result.pages, result.num_pages) == ([0, 1], 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.num_tokens = 0  # type: ignore[misc]


def test_insert_checks_page_count() -> None:
    cache = RadixCache(page_size=1)
    with pytest.raises(ValueError, match="3 tokens with page_size 1 need 3 pages"):
        cache.insert([1, 2, 3], [0, 1])
    cache = RadixCache(page_size=4)
    with pytest.raises(ValueError, match="need 2 pages \\(or 3 with a partial last page\\), got 4"):
        cache.insert(seq(10), [0, 1, 2, 3])


# page_size 16


def test_page_granular_insert_ignores_partial_page() -> None:
    cache = RadixCache(page_size=16)
    assert cache.insert(seq(40), [0, 1, 2]) == 0
    assert cache.total_size() == 2
    assert cached_prefixes(cache) == {tuple(seq(16)): 0, tuple(seq(32)): 1}
    assert cache.insert(seq(15), []) == 0
    cache.check_integrity()


def test_page_granular_match_rounds_down_to_a_page() -> None:
    cache = RadixCache(page_size=16)
    cache.insert(seq(48), [7, 8, 9])
    query = seq(48)
    query[20] = -1
    result = cache.match_prefix(query)
    assert (result.pages, result.num_tokens) == ([7], 16)
    assert result.node.key == seq(16)
    assert cache.match_prefix(seq(40)).pages == [7, 8]
    assert cache.match_prefix([0] + seq(47, 2)).num_tokens == 0
    cache.check_integrity()


def test_page_granular_divergence_in_first_page_makes_a_sibling() -> None:
    cache = RadixCache(page_size=16)
    cache.insert([0] * 32, [0, 1])
    assert cache.insert([0] * 15 + [1] + [0] * 16, [2, 3]) == 0
    assert cache.insert([0] * 16 + [1] * 16, [4, 5]) == 16
    assert set(cache.root.children) == {(0,) * 16, (0,) * 15 + (1,)}
    assert cache.total_size() == 5
    cache.check_integrity()


# locking and eviction


def test_lock_moves_pages_between_evictable_and_protected() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4, 5], [3, 4, 5, 6])
    node = cache.match_prefix([1, 2, 4, 5]).node
    cache.lock(node)
    cache.lock(node)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.check_integrity()
    cache.unlock(node)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.unlock(node)
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    with pytest.raises(ValueError, match="unlock without a matching lock"):
        cache.unlock(node)
    cache.lock(cache.root)
    cache.unlock(cache.root)
    cache.check_integrity()


def test_lock_survives_a_split_above_the_locked_node() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    upper = cache.match_prefix([1, 2]).node
    assert upper.lock_ref == 1 and node.key == [3, 4]
    assert cache.evict(10) == []
    cache.check_integrity()
    cache.unlock(node)
    assert sorted(cache.evict(10)) == [0, 1, 2, 3]
    cache.check_integrity()


def test_evict_takes_least_recently_used_leaf_first() -> None:
    allocator = PageAllocator(8)
    cache = RadixCache(page_size=1, allocator=allocator)
    for tokens in ([1, 1], [2, 2], [3, 3]):
        cache.insert(tokens, allocator.allocate(2))
    cache.match_prefix([1, 1])
    assert cache.evict(1) == [2, 3]
    assert cache.evict(3) == [4, 5, 0, 1]
    assert allocator.num_free == 8 and cache.total_size() == 0
    cache.check_integrity()


def test_evict_reaches_a_parent_once_its_children_are_gone() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [0, 1, 3])
    cache.insert([9], [4])
    cache.match_prefix([9])
    assert sorted(cache.evict(3)) == [0, 1, 2, 3]
    assert cached_prefixes(cache) == {(9,): 4}
    cache.check_integrity()


def test_evict_stops_at_locked_nodes_and_rejects_evicted_ones() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], [0, 1])
    cache.insert([1, 2, 5, 6], [0, 2])
    locked = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(locked)
    evicted = cache.match_prefix([1, 2, 5, 6]).node
    assert cache.evict(100) == [2]
    assert cache.evict(0) == []
    assert cache.evictable_size() == 0 and cache.protected_size() == 2
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(evicted)
    cache.unlock(locked)
    assert cache.evict(1) == [1]
    assert cache.evict(1) == [0]
    cache.check_integrity()


def test_disabled_cache_caches_nothing_but_counts_queries() -> None:
    cache = RadixCache(page_size=1, disable=True)
    assert cache.insert([1, 2], [0, 1]) == 0
    assert cache.match_prefix([1, 2]) == MatchResult([], cache.root, 0)
    assert cache.total_size() == 0 and cache.evict(5) == []
    assert cache.stats() == {
        "num_matches": 1,
        "matched_tokens": 0,
        "queried_tokens": 2,
        "hit_rate": 0.0,
    }


def test_stats_count_matched_over_queried_tokens() -> None:
    cache = RadixCache(page_size=2)
    assert cache.stats()["hit_rate"] == 0.0
    cache.insert([1, 2, 3, 4], [0, 1])
    cache.match_prefix([1, 2, 3, 4, 5])
    cache.match_prefix([1, 2, 9])
    assert cache.stats() == {
        "num_matches": 2,
        "matched_tokens": 6,
        "queried_tokens": 8,
        "hit_rate": 0.75,
    }


def test_reset_returns_pages_to_the_allocator() -> None:
    allocator = PageAllocator(4)
    cache = RadixCache(page_size=1, allocator=allocator)
    cache.insert([1, 2, 3], allocator.allocate(3))
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    with pytest.raises(RuntimeError, match="still locked"):
        cache.reset()
    cache.unlock(node)
    assert sorted(cache.reset()) == [0, 1, 2]
    assert allocator.num_free == 4 and cache.total_size() == 0
    assert cache.stats()["num_matches"] == 0
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(node)
    cache.check_integrity()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda c, n: setattr(n, "lock_ref", 1), "lock_ref"),
        (lambda c, n: n.value.__setitem__(0, c.root.children[1].value[0]), "held by two"),
        (lambda c, n: n.key.append(7), "pages for"),
        (lambda c, n: setattr(c, "_evictable_size", 0), "tracked evictable"),
        (lambda c, n: c.allocator.free([n.value[0]]), "free list"),
    ],
)
def test_check_integrity_names_the_broken_invariant(corrupt, message) -> None:
    allocator = PageAllocator(8)
    cache = RadixCache(page_size=1, allocator=allocator)
    cache.insert([1, 2], allocator.allocate(2))
    cache.insert([1, 3], [0, *allocator.allocate(1)])
    node = cache.match_prefix([1, 3]).node
    corrupt(cache, node)
    with pytest.raises(AssertionError, match=message):
        cache.check_integrity()


def test_pretty_print_shows_the_tree() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [0, 1])
    cache.insert([1, 3], [0, 2])
    assert cache.pretty_print().splitlines()[:3] == [
        "<root>",
        "  [1] pages=[0] lock_ref=0 t=2",
        "    [2] pages=[1] lock_ref=0 t=1",
    ]


# long and deep inputs: nothing may recurse


@pytest.mark.parametrize("page_size", [1, 16])
def test_hundred_thousand_token_prompt(page_size: int) -> None:
    n = 100_000
    allocator = PageAllocator(2 * n // page_size)
    cache = RadixCache(page_size=page_size, allocator=allocator)
    tokens = [i % 50_000 for i in range(n)]
    assert cache.insert(tokens, allocator.allocate(n // page_size)) == 0
    assert cache.match_prefix(tokens).num_tokens == n
    branch = tokens[: n // 2] + [-1] * (n // 2)
    result = cache.match_prefix(branch)
    assert result.num_tokens == n // 2
    cache.lock(result.node)
    rest = allocator.allocate(n // 2 // page_size)
    assert cache.insert(branch, result.pages + rest) == n // 2
    cache.unlock(result.node)
    cache.check_integrity()
    size = cache.total_size()
    assert size == 3 * n // 2 // page_size
    assert len(cache.evict(allocator.num_total)) == size
    assert allocator.num_free == allocator.num_total


def test_deep_tree() -> None:
    depth = 5000
    cache = RadixCache(page_size=1, allocator=PageAllocator(depth))
    tokens = seq(depth)
    cache.insert(tokens, cache.allocator.allocate(depth))
    for k in range(depth - 1, 0, -1):
        cache.match_prefix(tokens[:k])
    leaf = cache.match_prefix(tokens).node
    assert leaf.key == [depth - 1]
    cache.lock(leaf)
    cache.check_integrity()
    assert cache.protected_size() == depth
    cache.unlock(leaf)
    assert "  " * (depth - 1) in cache.pretty_print()
    assert len(cache.evict(depth)) == depth
    cache.check_integrity()


def test_doc_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert len(blocks) == 2  # the radix cache, then the sliding layers' window pages
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})


def test_lookahead_match_changes_neither_stats_nor_lru():
    cache = RadixCache(page_size=1, allocator=PageAllocator(16))
    a, b = [1, 2, 3], [4, 5, 6]
    cache.insert(a, cache.allocator.allocate(3))
    cache.insert(b, cache.allocator.allocate(3))
    before = cache.stats()
    assert cache.match_prefix(a, record=False).num_tokens == 3
    assert cache.stats() == before
    cache.evict(1)  # `a` was inserted first and the look-ahead did not refresh it
    assert cache.match_prefix(a).num_tokens == 0 and cache.match_prefix(b).num_tokens == 3


def test_page_names_are_content_addresses_that_follow_the_salt():
    from plait.radix_cache import chain_names, root_name

    a = RadixCache(page_size=2, salt=b"weights-a")
    b = RadixCache(page_size=2, salt=b"weights-a")
    other = RadixCache(page_size=2, salt=b"weights-b")
    tokens = seq(7)
    a.insert(tokens[:4], [0, 1])  # the same prefix cached in two steps and in one
    a.insert(tokens, [0, 1, 2, 3])
    b.insert(tokens, [5, 6, 7])
    other.insert(tokens, [0, 1, 2])
    names = a.path_names(a.match_prefix(tokens).node)
    assert names == b.path_names(b.match_prefix(tokens).node)
    assert names == chain_names(root_name(b"weights-a"), tokens, 2)
    assert len(names) == 3 and len(set(names)) == 3
    assert not set(names) & set(other.path_names(other.match_prefix(tokens).node))
    a.match_prefix(tokens[:2] + [9, 9])  # a split keeps each page's name
    assert a.path_names(a.match_prefix(tokens).node) == names
    a.check_integrity()
    assert RadixCache(page_size=2).path_names(RadixCache(page_size=2).root) == []
