"""A radix tree over token ids whose values are KV page indices, and the page allocator."""

from __future__ import annotations

from .allocator import OutOfPagesError, PageAllocator
from .node import MatchResult, TreeNode
from .radix_tree import RadixCache

__all__ = ["MatchResult", "OutOfPagesError", "PageAllocator", "RadixCache", "TreeNode"]
