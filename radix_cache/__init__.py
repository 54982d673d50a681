"""A radix tree over token ids whose values are KV page indices, the page allocator, and the
second pool of sliding-window layers' pages."""

from __future__ import annotations

from .allocator import OutOfPagesError, PageAllocator
from .node import MatchResult, TreeNode
from .radix_tree import RadixCache
from .window_pages import WindowPages

__all__ = [
    "MatchResult",
    "OutOfPagesError",
    "PageAllocator",
    "RadixCache",
    "TreeNode",
    "WindowPages",
]
