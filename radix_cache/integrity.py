"""Invariant checks and a debug view of a RadixCache tree (iterative: trees may be deep)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_names import chain_names
from .node import TreeNode

if TYPE_CHECKING:
    from .radix_tree import RadixCache


def _fail(message: str) -> None:
    raise AssertionError(f"radix cache integrity: {message}")


def _check_root(root: TreeNode) -> None:
    if root.parent is not None or root.key or root.value:
        _fail(f"root must have no parent, key or pages: {root!r}")
    if root.lock_ref or root.own_locks:
        _fail(f"root must never be locked: {root!r}")


def _check_edge(cache: RadixCache, node: TreeNode, parent: TreeNode) -> None:
    page_size = cache.page_size
    if not node.key:
        _fail(f"empty non-root node {node!r}")
    if len(node.key) % page_size:
        _fail(f"{node!r} key length {len(node.key)} is not a multiple of page_size {page_size}")
    if len(node.value) != len(node.key) // page_size:
        _fail(f"{node!r} has {len(node.value)} pages for {len(node.key)} tokens")
    if node.parent is not parent:
        _fail(f"{node!r} parent pointer does not name the node that holds it")
    if parent.children.get(cache._child_key(node.key, 0)) is not node:
        _fail(f"{node!r} is filed in its parent under a key other than its first page")
    if node.last_access > parent.last_access:
        _fail(f"{node!r} was accessed after its parent {parent!r}")
    _check_names(cache, node, parent)


def _check_names(cache: RadixCache, node: TreeNode, parent: TreeNode) -> None:
    if cache.root_name is None:
        if node.names:
            _fail(f"{node!r} carries page names in a cache that names none")
        return
    last = parent.names[-1] if parent is not cache.root else cache.root_name
    if node.names != chain_names(last, node.key, cache.page_size):
        _fail(f"{node!r} page names do not chain from its parent over its tokens")


def _check_locks(node: TreeNode) -> None:
    if node.own_locks < 0 or node.lock_ref < 0:
        _fail(f"negative lock count on {node!r}")
    below = sum(child.lock_ref for child in node.children.values())
    if node.lock_ref != node.own_locks + below:
        _fail(
            f"{node!r} lock_ref {node.lock_ref} != own locks {node.own_locks} "
            f"+ children's lock_ref {below}"
        )


def check_tree(cache: RadixCache) -> None:
    root = cache.root
    _check_root(root)
    seen_nodes: set[int] = {id(root)}
    seen_pages: set[int] = set()
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            if id(child) in seen_nodes:
                _fail(f"{child!r} is reachable twice")
            seen_nodes.add(id(child))
            _check_edge(cache, child, node)
            stack.append(child)
        if node is root:
            continue
        _check_locks(node)
        for page in node.value:
            if page in seen_pages:
                _fail(f"page {page} is held by two nodes (second: {node!r})")
            seen_pages.add(page)
        if node.lock_ref:
            protected += len(node.value)
        else:
            evictable += len(node.value)
            if not node.children:
                leaves.add(node)
    if (evictable, protected) != (cache._evictable_size, cache._protected_size):
        _fail(
            f"tracked evictable/protected {cache._evictable_size}/{cache._protected_size} "
            f"!= walked {evictable}/{protected}"
        )
    if leaves != cache._evictable_leaves:
        _fail(
            f"evictable leaf set is stale: {len(cache._evictable_leaves)} tracked, "
            f"{len(leaves)} walked"
        )
    allocator = cache.allocator
    if allocator is not None:
        for page in seen_pages:
            if not 0 <= page < allocator.num_total:
                _fail(f"cached page {page} is outside the allocator's pool")
            if allocator.is_free(page):
                _fail(f"cached page {page} is also on the allocator's free list")


def format_tree(root: TreeNode, max_key_tokens: int = 8) -> str:
    lines: list[str] = []
    stack: list[tuple[TreeNode, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if node is root:
            lines.append("<root>")
        else:
            more = "..." if len(node.key) > max_key_tokens else ""
            lines.append(
                f"{'  ' * depth}{node.key[:max_key_tokens]}{more} "
                f"pages={node.value[:max_key_tokens]}"
                f"{more} lock_ref={node.lock_ref} t={node.last_access}"
            )
        children = sorted(node.children.values(), key=lambda c: c.key)
        stack.extend((child, depth + 1) for child in reversed(children))
    return "\n".join(lines)
