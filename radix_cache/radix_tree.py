"""A radix tree from token ids to KV page indices, with LRU eviction of unlocked leaves."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from .allocator import PageAllocator
from .block_names import chain_names, root_name
from .integrity import check_tree, format_tree
from .node import ChildKey, MatchResult, TreeNode


class RadixCache:
    """Caches the KV pages of token prefixes so that requests sharing a prefix share pages.

    Only whole pages are cached: every edge holds a multiple of `page_size` tokens and
    one page index per `page_size` tokens, and edges split only at page boundaries.

    Ownership protocol for a request:
      1. `m = match_prefix(tokens)`, then `lock(m.node)`; `m.pages` stay valid while locked.
      2. Allocate pages for the rest of the tokens and run the model.
      3. `n = insert(tokens, pages)`; the tree keeps
         `pages[n // page_size : len(tokens) // page_size]`.
         The caller frees `pages[len(m.pages) : n // page_size]` (duplicates of pages another
         request cached meanwhile) and any page past the last whole page.
      4. `unlock(m.node)`.

    Locked nodes (and so all their ancestors) are never evicted. Not thread-safe.

    Hooks for observers, None unless the owner sets them, called after the operation:
    `on_match(result, queried_tokens)` for each recorded `match_prefix`, `on_insert(tokens,
    cached_tokens, new_pages)` when an insert gives the tree pages, `on_evict(freed, asked)` when
    an eviction frees pages. The engine points them at its event hub (`runtime/events.py`).

    With a `salt`, every cached page also carries its content address (`node.names`): a hash
    chain over the token ids from the first page, seeded by the salt (`block_names`).
    """

    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator | None = None,
        disable: bool = False,
        salt: bytes | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.disable = disable
        self.root_name = root_name(salt) if salt is not None else None
        self.on_match: Callable[[MatchResult, int], None] | None = None
        self.on_insert: Callable[[int, int, int], None] | None = None
        self.on_evict: Callable[[list[int], int], None] | None = None
        self._clear()
        self._reset_stats()

    # lookup and insertion

    def match_prefix(
        self,
        tokens: Sequence[int],
        record: bool = True,
        usable: Callable[[list[int]], int] | None = None,
    ) -> MatchResult:
        """With `record=False` (a look-ahead), neither the statistics nor the LRU order change.
        `usable(pages)`: how many leading pages of the longest match may be reused (the rest
        lack what the caller needs, e.g. sliding-window KV); the match ends there."""
        if record:
            self._num_matches += 1
            self._queried_tokens += len(tokens)
        if self.disable:
            return MatchResult([], self.root, 0)
        tokens = _as_list(tokens)
        end = self._aligned(len(tokens))
        if usable is not None:
            end = min(
                end, usable(self.match_prefix(tokens[:end], record=False).pages) * self.page_size
            )
        now = self._tick() if record else None
        node = self.root
        if now is not None:
            node.last_access = now
        pos = 0
        pages: list[int] = []
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            matched = self._match_length(child.key, tokens, pos, end)
            if matched < len(child.key):
                child = self._split(child, matched)
            if now is not None:
                child.last_access = now
            pages.extend(child.value)
            node = child
            pos += matched
        result = MatchResult(pages, node, pos)
        if record:
            self._matched_tokens += pos
            if self.on_match is not None:
                self.on_match(result, len(tokens))
        return result

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Caches the whole pages of `tokens`; returns how many tokens were cached already."""
        end = self._aligned(len(tokens))
        num_full = end // self.page_size
        max_pages = -(-len(tokens) // self.page_size)
        if not num_full <= len(pages) <= max_pages:
            raise ValueError(
                f"insert: {len(tokens)} tokens with page_size {self.page_size} need "
                f"{num_full} pages (or {max_pages} with a partial last page), got {len(pages)}"
            )
        if self.disable:
            return 0
        tokens = _as_list(tokens)
        now = self._tick()
        node = self.root
        node.last_access = now
        pos = 0
        while pos < end:
            key = self._child_key(tokens, pos)
            child = node.children.get(key)
            if child is None:
                new = TreeNode(
                    key=tokens[pos:end],
                    value=list(pages[pos // self.page_size : num_full]),
                    names=self._names_below(node, tokens[pos:end]),
                    parent=node,
                    last_access=now,
                )
                node.children[key] = new
                self._evictable_size += len(new.value)
                self._evictable_leaves.discard(node)
                self._evictable_leaves.add(new)
                if self.on_insert is not None:
                    self.on_insert(end, pos, len(new.value))
                return pos
            matched = self._match_length(child.key, tokens, pos, end)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = now
            node = child
            pos += matched
        return pos

    def path_names(self, node: TreeNode) -> list[bytes]:
        """The names of the pages from the first to `node`'s last (empty when pages are unnamed)."""
        parts: list[list[bytes]] = []
        while node is not self.root and node.parent is not None:
            parts.append(node.names)
            node = node.parent
        return [name for part in reversed(parts) for name in part]

    def _names_below(self, parent: TreeNode, tokens: list[int]) -> list[bytes]:
        if self.root_name is None:
            return []
        last = parent.names[-1] if parent is not self.root else self.root_name
        return chain_names(last, tokens, self.page_size)

    # locking

    def lock(self, node: TreeNode) -> None:
        self._check_attached(node, "lock")
        if node is self.root:
            return
        node.own_locks += 1
        cursor: TreeNode | None = node
        while cursor is not None and cursor is not self.root:
            if cursor.lock_ref == 0:
                self._evictable_size -= len(cursor.value)
                self._protected_size += len(cursor.value)
                self._evictable_leaves.discard(cursor)
            cursor.lock_ref += 1
            cursor = cursor.parent

    def unlock(self, node: TreeNode) -> None:
        self._check_attached(node, "unlock")
        if node is self.root:
            return
        if node.own_locks == 0:
            raise ValueError(f"unlock without a matching lock on {node!r}")
        node.own_locks -= 1
        cursor: TreeNode | None = node
        while cursor is not None and cursor is not self.root:
            cursor.lock_ref -= 1
            if cursor.lock_ref == 0:
                self._evictable_size += len(cursor.value)
                self._protected_size -= len(cursor.value)
                if not cursor.children:
                    self._evictable_leaves.add(cursor)
            cursor = cursor.parent

    # eviction

    def evict(self, num_pages: int) -> list[int]:
        """Frees at least `num_pages` pages (fewer if not enough are evictable).

        Removes unlocked leaves, least recently used first; a parent left childless
        becomes a candidate in turn. Returns the freed page indices, which have already
        been handed back to the allocator when the cache has one.
        """
        freed: list[int] = []
        if num_pages <= 0 or not self._evictable_leaves:
            return freed
        heap = [(leaf.last_access, leaf.id, leaf) for leaf in self._evictable_leaves]
        heapq.heapify(heap)
        while len(freed) < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            freed.extend(leaf.value)
            self._evictable_size -= len(leaf.value)
            self._evictable_leaves.discard(leaf)
            del parent.children[self._child_key(leaf.key, 0)]
            leaf.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._evictable_leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if self.allocator is not None:
            self.allocator.free(freed)
        if self.on_evict is not None and freed:
            self.on_evict(freed, num_pages)
        return freed

    # sizes, statistics, maintenance

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def pages(self) -> list[int]:
        """Every page the tree holds (O(tree size))."""
        found: list[int] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.extend(node.value)
            stack.extend(node.children.values())
        return found

    def stats(self) -> dict[str, int | float]:
        queried = self._queried_tokens
        return {
            "num_matches": self._num_matches,
            "matched_tokens": self._matched_tokens,
            "queried_tokens": queried,
            "hit_rate": self._matched_tokens / queried if queried else 0.0,
        }

    def reset(self) -> list[int]:
        """Empties the tree and the statistics; returns the pages it held (freed into the
        allocator)."""
        if self._protected_size:
            raise RuntimeError(
                f"reset: {self._protected_size} cached pages are still locked by running requests"
            )
        pages: list[int] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            pages.extend(node.value)
            stack.extend(node.children.values())
            node.parent = None
        if self.allocator is not None:
            self.allocator.free(pages)
        self._clear()
        self._reset_stats()
        return pages

    def check_integrity(self) -> None:
        """Raises AssertionError naming the first broken invariant."""
        check_tree(self)

    def pretty_print(self, max_key_tokens: int = 8) -> str:
        return format_tree(self.root, max_key_tokens)

    @property
    def clock(self) -> int:
        """The cache's logical time: one tick per recorded match or insert since the last flush
        (a node's `last_access` is a reading of it)."""
        return self._clock

    # internals

    def _clear(self) -> None:
        self.root = TreeNode()
        self._evictable_size = 0
        self._protected_size = 0
        self._evictable_leaves: set[TreeNode] = set()
        self._clock = 0

    def _reset_stats(self) -> None:
        self._num_matches = 0
        self._matched_tokens = 0
        self._queried_tokens = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _aligned(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self.page_size

    def _child_key(self, tokens: list[int], pos: int) -> ChildKey:
        if self.page_size == 1:
            return tokens[pos]
        return tuple(tokens[pos : pos + self.page_size])

    def _match_length(self, key: list[int], tokens: list[int], pos: int, end: int) -> int:
        n = min(len(key), end - pos)
        if key[:n] == tokens[pos : pos + n]:
            return n
        i = 0
        while key[i] == tokens[pos + i]:
            i += 1
        return self._aligned(i)

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cuts `node`'s edge after `at` tokens; returns the new upper node.

        NOTE: `node` keeps the lower part, so references held by lockers still name the
        same full prefix. The upper node inherits `lock_ref` (every lock below it passes through).
        """
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % self.page_size == 0
        upper = TreeNode(
            key=node.key[:at],
            value=node.value[: at // self.page_size],
            names=node.names[: at // self.page_size],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[at:]
        node.value = node.value[at // self.page_size :]
        node.names = node.names[at // self.page_size :]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def _check_attached(self, node: TreeNode, verb: str) -> None:
        if node is not self.root and node.parent is None:
            raise ValueError(f"{verb}: {node!r} is not in this cache (evicted or reset)")

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, total={self.total_size()}, "
            f"evictable={self._evictable_size}, protected={self._protected_size})"
        )


def _as_list(tokens: Sequence[int]) -> list[int]:
    return tokens if isinstance(tokens, list) else list(tokens)
