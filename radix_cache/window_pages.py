"""The pages of sliding-window layers: a second, smaller pool beside the one the tree indexes.

A model whose layers attend through a sliding window of `window` tokens needs their keys and
values only for the last `window` positions before each query. Its *logical* pages (the ones
requests and the radix tree hold, `PageAllocator`) then carry the KV of the full-attention layers,
and each logical page may also be *attached* to a window page, which carries the sliding layers'
KV for the same positions. A logical page whose window page was released is a tombstone for the
sliding layers: its full-layer KV is still there, its window KV is not.

Who holds a window page:
  - a request's own logical page (not in the tree) owns its window page until the request moves
    past it (`detach`) or frees the logical page;
  - a tree page's window page is *locked* by every request whose window still covers it (`lock`
    / `unlock`); an unlocked one is evictable, oldest unlock first (`evict`);
  - freeing a logical page (the tree's eviction, a request's release) detaches its window page:
    hook `logical_freed` to the logical allocator's `on_free`.

Every window page is then free or attached to exactly one logical page:
`allocator.num_free + num_attached == num_pages`. Pure Python, no tensors: `of` is an
`array('q')` (logical page -> window page or -1) that the model runner reads in place.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from .allocator import PageAllocator


class WindowPages:
    def __init__(self, num_logical: int, num_pages: int, window: int, page_size: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        self.window = window
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.of = array("q", [-1]) * num_logical  # logical page -> its window page, -1: none
        self.locks = array("l", [0]) * num_logical  # requests whose window covers a tree page
        # unlocked tree pages with a window page, the earliest unlocked first
        self._evictable: dict[int, None] = {}
        self.num_attached = 0

    @property
    def num_pages(self) -> int:
        return self.allocator.num_total

    def first_needed(self, position: int) -> int:
        """The first page a query at `position` (or later) reads through the window."""
        return max(0, position - self.window + 1) // self.page_size

    def usable(self, pages: Sequence[int]) -> int:
        """How many leading pages of a cached prefix a request may reuse: the longest run after
        which every page the next query reads through its window still has its window page."""
        best = run = 0
        for i, page in enumerate(pages):
            run = run + 1 if self.of[page] >= 0 else 0
            end = (i + 1) * self.page_size  # the next query's position
            if run >= i + 1 - self.first_needed(end):
                best = i + 1
        return best

    # attaching and releasing -----------------------------------------------------------------

    def available(self) -> int:
        return self.allocator.num_free + len(self._evictable)

    def attach(self, logical: Sequence[int]) -> bool:
        """Gives each of `logical` (none attached yet) a window page, evicting unlocked cached
        ones if short; False (and nothing attached) when there are not enough."""
        short = len(logical) - self.allocator.num_free
        if short > 0:
            if short > len(self._evictable):
                return False
            self.evict(short)
        for page, window_page in zip(logical, self.allocator.allocate(len(logical))):
            self.of[page] = window_page
        self.num_attached += len(logical)
        return True

    def detach(self, logical: Iterable[int]) -> None:
        """Releases the window pages of `logical` that have one."""
        freed = []
        for page in logical:
            window_page = self.of[page]
            if window_page >= 0:
                freed.append(window_page)
                self.of[page] = -1
                self._evictable.pop(page, None)
        self.num_attached -= len(freed)
        self.allocator.free(freed)

    def logical_freed(self, logical: list[int]) -> None:
        """The logical allocator's `on_free`: a freed page's window page goes with it."""
        self.detach(logical)

    def move(self, source: int, target: int) -> None:
        """Gives `target` (without one) the window page of `source`, which holds the same
        positions' KV (a request's duplicate of a tree page that lost its window page)."""
        assert self.of[target] < 0 <= self.of[source], (source, target)
        self.of[target], self.of[source] = self.of[source], -1

    # the tree's pages --------------------------------------------------------------------------

    def lock(self, logical: Iterable[int]) -> None:
        for page in logical:
            self.locks[page] += 1
            self._evictable.pop(page, None)

    def unlock(self, logical: Iterable[int]) -> None:
        for page in logical:
            self.locks[page] -= 1
            if self.locks[page] == 0 and self.of[page] >= 0:
                self._evictable[page] = None

    def evict(self, num_pages: int) -> int:
        """Releases the window pages of up to `num_pages` unlocked tree pages, earliest unlocked
        first; returns how many."""
        victims = []
        for page in self._evictable:
            if len(victims) == num_pages:
                break
            victims.append(page)
        self.detach(victims)
        return len(victims)

    def reset(self) -> None:
        self.allocator.reset()
        self.of = array("q", [-1]) * len(self.of)
        self.locks = array("l", [0]) * len(self.locks)
        self._evictable.clear()
        self.num_attached = 0

    # accounting ---------------------------------------------------------------------------

    def check(self, tree_pages: set[int], expected_locks: dict[int, int]) -> None:
        """Raises AssertionError unless every window page is free or attached once, the locks
        are the ones the requests hold (`expected_locks`, page -> count), and the evictable
        pages are exactly the unlocked tree pages that have a window page."""
        attached = [w for w in self.of if w >= 0]
        assert len(attached) == self.num_attached == len(set(attached)), (
            f"window pages: {len(attached)} attached, {len(set(attached))} distinct, "
            f"counted {self.num_attached}"
        )
        assert self.allocator.num_free + len(attached) == self.allocator.num_total, (
            f"window pages: free {self.allocator.num_free} + attached {len(attached)} "
            f"!= pool {self.allocator.num_total}"
        )
        assert not any(self.allocator.is_free(w) for w in attached), "an attached page is free"
        held = {p: n for p, n in enumerate(self.locks) if n}
        assert held == expected_locks, f"window locks {held} != the requests' {expected_locks}"
        evictable = {p for p in tree_pages if self.of[p] >= 0 and not self.locks[p]}
        assert set(self._evictable) == evictable, (
            f"evictable window pages {sorted(self._evictable)} != {sorted(evictable)}"
        )
