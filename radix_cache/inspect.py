"""A read-only summary of a `RadixCache` for people: its largest branches and its totals.

`summarize_tree` never changes the cache (no split, no LRU touch, no statistics). It may run on
another thread than the one that mutates the tree: it copies each node's children before walking
them and retries when the tree changed under it, so its figures are a consistent-enough picture,
not a transaction.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field

from .node import TreeNode
from .radix_tree import RadixCache

_RETRIES = 3


@dataclass(frozen=True, slots=True)
class NodeSummary:
    """One shown node. `subtree_*` count this node's edge and everything below it."""

    id: int
    parent: int | None  # None for the root
    depth: int
    tokens: int
    pages: int
    subtree_tokens: int
    subtree_pages: int
    subtree_nodes: int
    num_children: int
    locked: bool  # some request holds a lock on it or below it: never evicted while so
    own_locks: int
    last_access: int  # the cache's logical clock at the last match or insert through it
    hits: int | None = None  # matches that reached it, when the caller counts them
    key_head: tuple[int, ...] = ()  # the first token ids of its edge, when asked for

    @property
    def evictable(self) -> bool:
        return not self.locked


@dataclass(frozen=True)
class TreeSummary:
    """The root first, then the largest branches by tokens, each parent before its children."""

    nodes: list[NodeSummary] = field(default_factory=list)
    num_nodes: int = 0  # nodes walked, the root excluded
    num_tokens: int = 0
    cached_pages: int = 0
    evictable_pages: int = 0
    protected_pages: int = 0
    clock: int = 0
    truncated: bool = False  # the walk stopped at `max_walk` nodes; totals count what it saw


def summarize_tree(
    cache: RadixCache,
    max_nodes: int = 64,
    hits: Mapping[int, int] | None = None,
    key_tokens: int = 0,
    max_walk: int = 100_000,
) -> TreeSummary:
    """Shows at most `max_nodes` nodes besides the root: at each step the largest branch (by
    subtree tokens) whose parent is already shown. `hits` maps node ids to counts the caller
    keeps; `key_tokens` > 0 includes that many leading token ids of each shown edge."""
    for attempt in range(_RETRIES):
        try:
            return _summarize(cache, max_nodes, hits, key_tokens, max_walk)
        except RuntimeError:  # a dict changed size while copied: the tree moved; look again
            if attempt == _RETRIES - 1:
                raise
    raise AssertionError("unreachable")


def _summarize(
    cache: RadixCache,
    max_nodes: int,
    hits: Mapping[int, int] | None,
    key_tokens: int,
    max_walk: int,
) -> TreeSummary:
    root = cache.root
    children: dict[int, tuple[TreeNode, ...]] = {}
    order: list[TreeNode] = []
    stack = [root]
    truncated = False
    while stack:  # pre-order; sizes are summed in reverse below
        node = stack.pop()
        if len(order) > max_walk:
            truncated = True
            break
        kids = tuple(node.children.values())
        children[node.id] = kids
        order.append(node)
        stack.extend(kids)
    sizes: dict[int, tuple[int, int, int]] = {}  # id -> (tokens, pages, nodes) of its subtree
    for node in reversed(order):
        tokens, pages, count = len(node.key), len(node.value), 1
        for kid in children[node.id]:
            k = sizes.get(kid.id)
            if k is not None:
                tokens, pages, count = tokens + k[0], pages + k[1], count + k[2]
        sizes[node.id] = (tokens, pages, count)

    def summary(node: TreeNode, parent: int | None, depth: int) -> NodeSummary:
        tokens, pages, count = sizes[node.id]
        return NodeSummary(
            id=node.id,
            parent=parent,
            depth=depth,
            tokens=len(node.key),
            pages=len(node.value),
            subtree_tokens=tokens,
            subtree_pages=pages,
            subtree_nodes=count - (node is root),
            num_children=len(children[node.id]),
            locked=node.lock_ref > 0,
            own_locks=node.own_locks,
            last_access=node.last_access,
            hits=None if hits is None else hits.get(node.id, 0),
            key_head=tuple(node.key[:key_tokens]) if key_tokens > 0 else (),
        )

    shown = [summary(root, None, 0)]
    heap: list[tuple[int, int, TreeNode, int, int]] = []

    def offer(node: TreeNode, depth: int) -> None:
        for kid in children.get(node.id, ()):
            if kid.id in sizes:
                heapq.heappush(heap, (-sizes[kid.id][0], kid.id, kid, node.id, depth + 1))

    offer(root, 0)
    while heap and len(shown) <= max_nodes:
        _, _, node, parent, depth = heapq.heappop(heap)
        shown.append(summary(node, parent, depth))
        offer(node, depth)
    whole_tokens, _, whole_nodes = sizes[root.id]
    evictable = cache.evictable_size()
    protected = cache.protected_size()
    return TreeSummary(
        nodes=shown,
        num_nodes=whole_nodes - 1,
        num_tokens=whole_tokens,
        cached_pages=evictable + protected,
        evictable_pages=evictable,
        protected_pages=protected,
        clock=cache.clock,
        truncated=truncated,
    )
