"""A radix tree over token ids whose values are KV page indices, the page allocator, and the
second pool of sliding-window layers' pages."""

from __future__ import annotations

from .allocator import OutOfPagesError, PageAllocator
from .block_names import NAME_BYTES, chain_names, root_name
from .node import MatchResult, TreeNode
from .radix_tree import RadixCache
from .window_pages import WindowPages

__all__ = [
    "NAME_BYTES",
    "MatchResult",
    "OutOfPagesError",
    "PageAllocator",
    "RadixCache",
    "TreeNode",
    "WindowPages",
    "chain_names",
    "root_name",
]
