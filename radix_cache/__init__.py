"""A radix tree over token ids whose values are KV page indices, and the page allocator."""

from __future__ import annotations

from .allocator import OutOfPagesError, PageAllocator
from .block_names import NAME_BYTES, chain_names, root_name
from .node import MatchResult, TreeNode
from .radix_tree import RadixCache

__all__ = [
    "NAME_BYTES",
    "MatchResult",
    "OutOfPagesError",
    "PageAllocator",
    "RadixCache",
    "TreeNode",
    "chain_names",
    "root_name",
]
