"""The radix tree's node and the result of a prefix match."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

ChildKey = int | tuple[int, ...]

_node_ids = itertools.count()


@dataclass(eq=False, slots=True)
class TreeNode:
    """One edge of the tree: `key` tokens and the `value` pages that hold their KV.

    `names` holds each page's content address (`block_names.chain_names`) when the cache names
    its pages, else it is empty.

    `lock_ref` counts the `lock()` calls held on this node or any descendant;
    `own_locks` counts those held on this node itself. A node with `lock_ref > 0`
    is never evicted. `last_access` is the cache's logical clock at the last match
    or insert that walked through the node.
    """

    key: list[int] = field(default_factory=list)
    value: list[int] = field(default_factory=list)
    names: list[bytes] = field(default_factory=list)
    parent: TreeNode | None = None
    children: dict[ChildKey, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    own_locks: int = 0
    last_access: int = 0
    id: int = field(default_factory=lambda: next(_node_ids))

    def __repr__(self) -> str:
        head = self.key[:8]
        more = "..." if len(self.key) > 8 else ""
        return (
            f"TreeNode(id={self.id}, key={head}{more} ({len(self.key)} tokens), "
            f"pages={len(self.value)}, lock_ref={self.lock_ref})"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a query.

    `pages` are the cache's own pages for the first `num_tokens` tokens; `node` is the
    deepest node of that prefix (the root when nothing matched). Lock `node` before
    reading `pages` across a call that may evict.
    """

    pages: list[int]
    node: TreeNode
    num_tokens: int

    @property
    def num_pages(self) -> int:
        return len(self.pages)
