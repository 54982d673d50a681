"""The radix cache under random operation sequences, against a page-level reference model."""

from __future__ import annotations

import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from plait.radix_cache import (
    MatchResult,
    PageAllocator,
    RadixCache,
    TreeNode,
    chain_names,
    root_name,
)
from tests.unit.test_radix_cache import cached_prefixes


@dataclasses.dataclass
class Running:
    tokens: list[int]
    pages: list[int]
    node: TreeNode
    num_matched_pages: int


class ReferenceCache:
    """The cache as a dict of page-aligned prefixes, each with its page and last access."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.page_of: dict[tuple[int, ...], int] = {}
        self.stamp: dict[tuple[int, ...], int] = {}
        self.clock = 0

    def _prefixes(self, tokens: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[: k * ps]) for k in range(1, len(tokens) // ps + 1)]

    def match(self, tokens: list[int]) -> list[int]:
        self.clock += 1
        pages = []
        for prefix in self._prefixes(tokens):
            if prefix not in self.page_of:
                break
            pages.append(self.page_of[prefix])
            self.stamp[prefix] = self.clock
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        self.clock += 1
        cached = 0
        for k, prefix in enumerate(self._prefixes(tokens)):
            if prefix in self.page_of:
                assert cached == k * self.page_size, "cached prefixes must be prefix-closed"
                cached += self.page_size
            else:
                self.page_of[prefix] = pages[k]
            self.stamp[prefix] = self.clock
        return cached

    def protected(self, locked: list[tuple[int, ...]]) -> set[tuple[int, ...]]:
        return {p for p in self.page_of if any(lk[: len(p)] == p for lk in locked)}

    def eviction_order(self, locked: list[tuple[int, ...]]) -> list[int]:
        protected = self.protected(locked)
        alive = set(self.page_of)
        order = []
        while True:
            parents = {p[: -self.page_size] for p in alive}
            leaves = [p for p in alive if p not in parents and p not in protected]
            if not leaves:
                return order
            victim = min(leaves, key=lambda p: (self.stamp[p], -len(p)))
            alive.remove(victim)
            order.append(self.page_of[victim])

    def drop_pages(self, pages: list[int]) -> None:
        gone = set(pages)
        for prefix in [p for p, page in self.page_of.items() if page in gone]:
            del self.page_of[prefix]
            del self.stamp[prefix]


def token_sequences(page_size: int) -> st.SearchStrategy[list[int]]:
    if page_size == 1:
        return st.lists(st.integers(0, 2), max_size=10)
    half = page_size // 2
    pages = [[0] * page_size, [1] * page_size, [0] * half + [1] * half, [0] * (page_size - 1) + [2]]
    whole = st.lists(st.sampled_from(pages), max_size=4)
    tail = st.lists(st.integers(0, 2), max_size=page_size + 1)
    return st.builds(lambda ws, t: [tok for w in ws for tok in w] + t, whole, tail)


def named_prefixes(cache: RadixCache) -> dict[tuple[int, ...], bytes]:
    """Every cached page-aligned prefix mapped to the name its last page carries."""
    out: dict[tuple[int, ...], bytes] = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for i, name in enumerate(node.names):
            out[path + tuple(node.key[: (i + 1) * cache.page_size])] = name
        for child in node.children.values():
            stack.append((child, path + tuple(node.key)))
    return out


def make_machine(
    page_size: int, num_pages: int, salt: bytes | None = None
) -> type[RuleBasedStateMachine]:
    prompts = token_sequences(page_size)

    class CacheMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.allocator = PageAllocator(num_pages)
            self.cache = RadixCache(page_size, self.allocator, salt=salt)
            self.model = ReferenceCache(page_size)
            self.running: list[Running] = []
            self.queried = self.matched = 0

        def _match(self, tokens: list[int]) -> MatchResult:
            result = self.cache.match_prefix(tokens)
            expected = self.model.match(tokens)
            assert result.pages == expected
            assert result.num_tokens == len(expected) * page_size
            self.queried += len(tokens)
            self.matched += result.num_tokens
            return result

        def _locked_prefixes(self) -> list[tuple[int, ...]]:
            return [tuple(r.tokens[: r.num_matched_pages * page_size]) for r in self.running]

        def _evict(self, n: int) -> None:
            evictable = self.cache.evictable_size()
            order = self.model.eviction_order(self._locked_prefixes())
            freed = self.cache.evict(n)
            assert len(freed) >= min(n, evictable)
            if len(freed) < n:
                assert self.cache.evictable_size() == 0
            assert sorted(freed) == sorted(order[: len(freed)])
            self.model.drop_pages(freed)

        def _allocate(self, n: int) -> list[int] | None:
            if not self.allocator.can_allocate(n):
                self._evict(n - self.allocator.num_free)
            return self.allocator.allocate(n) if self.allocator.can_allocate(n) else None

        @rule(tokens=prompts)
        def match(self, tokens: list[int]) -> None:
            self._match(tokens)

        @rule(tokens=prompts)
        def start_request(self, tokens: list[int]) -> None:
            result = self._match(tokens)
            self.cache.lock(result.node)
            own = self._allocate(-(-len(tokens) // page_size) - result.num_pages)
            if own is None:
                self.cache.unlock(result.node)
                return
            self.running.append(Running(tokens, result.pages + own, result.node, result.num_pages))

        @precondition(lambda self: self.running)
        @rule(index=st.integers(0, 7), abort=st.booleans())
        def finish_request(self, index: int, abort: bool) -> None:
            req = self.running.pop(index % len(self.running))
            if abort:
                self.allocator.free(req.pages[req.num_matched_pages :])
            else:
                cached = self.cache.insert(req.tokens, req.pages)
                assert cached == self.model.insert(req.tokens, req.pages)
                assert cached >= req.num_matched_pages * page_size
                whole = len(req.tokens) // page_size
                dup = req.pages[req.num_matched_pages : cached // page_size]
                self.allocator.free(dup + req.pages[whole:])
            self.cache.unlock(req.node)

        @rule(tokens=prompts)
        def insert_fresh(self, tokens: list[int]) -> None:
            pages = self._allocate(len(tokens) // page_size)
            if pages is None:
                return
            cached = self.cache.insert(tokens, pages)
            assert cached == self.model.insert(tokens, pages)
            self.allocator.free(pages[: cached // page_size])

        @rule(n=st.integers(0, 8))
        def evict(self, n: int) -> None:
            self._evict(n)

        @invariant()
        def consistent(self) -> None:
            self.cache.check_integrity()
            in_use = sum(len(r.pages) - r.num_matched_pages for r in self.running)
            assert self.allocator.num_free + self.cache.total_size() + in_use == num_pages
            assert cached_prefixes(self.cache) == self.model.page_of
            if salt is not None:  # a page's name is its prefix's, however the tree was cut
                expected = {
                    p: chain_names(root_name(salt), list(p), page_size)[-1]
                    for p in self.model.page_of
                }
                assert named_prefixes(self.cache) == expected
            protected = len(self.model.protected(self._locked_prefixes()))
            assert self.cache.protected_size() == protected
            assert self.cache.evictable_size() == len(self.model.page_of) - protected
            stats = self.cache.stats()
            assert (stats["queried_tokens"], stats["matched_tokens"]) == (
                self.queried,
                self.matched,
            )

        def teardown(self) -> None:
            for req in self.running:
                self.cache.unlock(req.node)
                self.allocator.free(req.pages[req.num_matched_pages :])
            self.cache.reset()
            assert self.allocator.num_free == num_pages

    CacheMachine.TestCase.settings = settings(
        max_examples=60, stateful_step_count=30, deadline=None
    )
    return CacheMachine


TestCachePage1 = make_machine(page_size=1, num_pages=20).TestCase
TestCachePage4 = make_machine(page_size=4, num_pages=10).TestCase
TestCachePage16 = make_machine(page_size=16, num_pages=8).TestCase
TestNamedCachePage1 = make_machine(page_size=1, num_pages=20, salt=b"model-a").TestCase
TestNamedCachePage4 = make_machine(page_size=4, num_pages=10, salt=b"model-a").TestCase
