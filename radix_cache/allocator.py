"""A free list of KV page indices."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable


class OutOfPagesError(MemoryError):
    """Raised by `PageAllocator.allocate` when fewer pages are free than requested."""

    def __init__(self, requested: int, num_free: int) -> None:
        super().__init__(f"cannot allocate {requested} KV pages: only {num_free} free")
        self.requested = requested
        self.num_free = num_free


class PageAllocator:
    """Hands out page indices 0..num_pages-1 and takes them back, lowest free index first.

    Lowest-first keeps a request's pages in ascending, mostly adjacent runs however the pool was
    used before: attention on the CPU reads each page's rows in that order, and pages scattered
    over the pool (as a last-in-first-out list leaves them after a while) slow a batch's decode.
    `allocate` and `free` cost O(pages moved x log(pool size)) (a heap). Freeing a page that is
    already free, or one outside the pool, raises `ValueError` and frees nothing.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_total = num_pages
        # called with every list of pages freed (after the checks): what hangs on a page goes too
        self.on_free: Callable[[list[int]], None] | None = None
        self.reset()

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_total - len(self._free)

    def is_free(self, page: int) -> bool:
        self._check_range(page)
        return bool(self._is_free[page])

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfPagesError(n, len(self._free))
        if n == 0:
            return []
        if n == len(self._free):
            pages = sorted(self._free)
            self._free.clear()
        else:
            pop = heapq.heappop
            pages = [pop(self._free) for _ in range(n)]
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for i, page in enumerate(pages):
            try:
                self._check_range(page)
                if self._is_free[page]:
                    raise ValueError(f"double free of KV page {page}")
            except ValueError:
                for marked in pages[:i]:
                    self._is_free[marked] = 0
                raise
            self._is_free[page] = 1
        if self.on_free is not None and pages:
            self.on_free(pages)
        if len(pages) > len(self._free) // 4:
            self._free.extend(pages)
            heapq.heapify(self._free)  # O(pool), cheaper than a push per page here
        else:
            for page in pages:
                heapq.heappush(self._free, page)

    def reset(self) -> None:
        self._free = list(range(self._num_total))  # ascending: already a heap
        self._is_free = bytearray(b"\x01") * self._num_total

    def _check_range(self, page: int) -> None:
        if not 0 <= page < self._num_total:
            raise ValueError(f"KV page index {page} out of range [0, {self._num_total})")

    def __repr__(self) -> str:
        return f"PageAllocator(num_free={self.num_free}, num_total={self.num_total})"
