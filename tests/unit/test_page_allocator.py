from __future__ import annotations

import random

import pytest

from plait.radix_cache import OutOfPagesError, PageAllocator


def test_fresh_pool_hands_out_ascending_pages() -> None:
    allocator = PageAllocator(8)
    assert (allocator.num_free, allocator.num_total, allocator.num_used) == (8, 8, 0)
    assert allocator.allocate(3) == [0, 1, 2]
    assert allocator.allocate(2) == [3, 4]
    assert allocator.num_free == 3
    assert allocator.allocate(0) == []


def test_can_allocate_and_out_of_pages() -> None:
    allocator = PageAllocator(4)
    assert allocator.can_allocate(4)
    assert not allocator.can_allocate(5)
    assert not allocator.can_allocate(-1)
    allocator.allocate(3)
    with pytest.raises(OutOfPagesError, match="cannot allocate 2 KV pages: only 1 free") as info:
        allocator.allocate(2)
    assert (info.value.requested, info.value.num_free) == (2, 1)
    assert isinstance(info.value, MemoryError)
    assert allocator.num_free == 1
    with pytest.raises(ValueError, match="negative"):
        allocator.allocate(-1)


def test_free_returns_pages_and_reuses_them() -> None:
    allocator = PageAllocator(4)
    pages = allocator.allocate(4)
    allocator.free(pages[1:3])
    assert allocator.num_free == 2
    assert sorted(allocator.allocate(2)) == [1, 2]
    assert allocator.num_free == 0


def test_double_free_and_out_of_range_raise_and_free_nothing() -> None:
    allocator = PageAllocator(4)
    allocator.allocate(2)
    with pytest.raises(ValueError, match="double free of KV page 3"):
        allocator.free([0, 3])
    assert allocator.num_free == 2
    assert not allocator.is_free(0)
    with pytest.raises(ValueError, match="double free of KV page 1"):
        allocator.free([1, 1])
    assert allocator.num_free == 2
    with pytest.raises(ValueError, match="out of range"):
        allocator.free([0, 4])
    with pytest.raises(ValueError, match="out of range"):
        allocator.free([-1])
    assert allocator.num_free == 2
    allocator.free([0, 1])
    assert allocator.num_free == 4


def test_reset_frees_everything() -> None:
    allocator = PageAllocator(5)
    allocator.allocate(5)
    allocator.reset()
    assert allocator.num_free == 5
    assert allocator.allocate(5) == [0, 1, 2, 3, 4]


def test_empty_pool_and_bad_size() -> None:
    allocator = PageAllocator(0)
    assert allocator.can_allocate(0)
    assert not allocator.can_allocate(1)
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(-1)


def test_random_allocate_free_keeps_pages_distinct() -> None:
    rng = random.Random(0)
    allocator = PageAllocator(100)
    held: list[int] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            allocator.free(held[:k])
            del held[:k]
        else:
            n = rng.randint(0, 10)
            if allocator.can_allocate(n):
                held.extend(allocator.allocate(n))
        assert len(set(held)) == len(held)
        assert allocator.num_free + len(held) == 100
        assert all(not allocator.is_free(p) for p in held)


def test_lowest_free_pages_come_first_whatever_the_order_they_were_freed() -> None:
    """A request's KV stays in ascending runs after traffic has scattered the free list."""
    alloc = PageAllocator(64)
    pages = alloc.allocate(64)
    rng = random.Random(0)
    rng.shuffle(pages)
    alloc.free(pages[:40])  # many at once (heapified) ...
    for page in pages[40:]:
        alloc.free([page])  # ... and one by one (pushed)
    assert alloc.allocate(10) == list(range(10))
    alloc.free([3, 7])
    assert alloc.allocate(3) == [3, 7, 10]
    assert alloc.allocate(alloc.num_free) == list(range(11, 64))
