"""`PrefixTree`: the router's approximate picture of one replica's radix cache.

It keys on the characters of the prompt text (the router has no tokenizer and sees chat
messages before any template renders them), remembers what was routed to the replica, and
forgets least-recently-used leaves once it holds more than `max_chars`. It is approximate by
design: the replica evicts on its own schedule and the tree never learns of it.
"""

from __future__ import annotations

import itertools


class _Node:
    __slots__ = ("children", "edge", "last_access", "parent")

    def __init__(self, edge: str, parent: _Node | None) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of the child's edge -> child
        self.last_access = 0


class PrefixTree:
    def __init__(self, max_chars: int = 1_000_000) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars: must be positive, got {max_chars}")
        self.max_chars = max_chars
        self.root = _Node("", None)
        self.num_chars = 0
        self._clock = itertools.count(1)

    def match_prefix(self, text: str) -> int:
        """How many leading characters of `text` the tree holds (touching what matched)."""
        node, matched = self.root, 0
        now = next(self._clock)
        while matched < len(text):
            child = node.children.get(text[matched])
            if child is None:
                break
            common = _common_prefix(child.edge, text, matched)
            child.last_access = now
            matched += common
            if common < len(child.edge):
                break
            node = child
        return matched

    def insert(self, text: str) -> None:
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node)
                leaf.last_access = now
                node.children[text[pos]] = leaf
                self.num_chars += len(text) - pos
                break
            common = _common_prefix(child.edge, text, pos)
            if common < len(child.edge):
                child = self._split(child, common)
            child.last_access = now
            node, pos = child, pos + common
        if self.num_chars > self.max_chars:
            self.evict(self.num_chars - self.max_chars)

    def evict(self, num_chars: int) -> int:
        """Drops least-recently-used leaves until `num_chars` are gone; returns how many went."""
        freed = 0
        while freed < num_chars:
            leaves = sorted(self._leaves(), key=lambda n: n.last_access)
            if not leaves:
                break
            for leaf in leaves:  # parents left childless become leaves for the next round
                if freed >= num_chars:
                    break
                assert leaf.parent is not None
                del leaf.parent.children[leaf.edge[0]]
                freed += len(leaf.edge)
                self.num_chars -= len(leaf.edge)
        return freed

    def clear(self) -> None:
        self.root = _Node("", None)
        self.num_chars = 0

    def _split(self, child: _Node, at: int) -> _Node:
        """Cuts `child`'s edge after `at` characters; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.edge[:at], parent)
        upper.last_access = child.last_access
        parent.children[upper.edge[0]] = upper
        child.edge = child.edge[at:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out


def _common_prefix(edge: str, text: str, start: int) -> int:
    n = min(len(edge), len(text) - start)
    i = 0
    while i < n and edge[i] == text[start + i]:
        i += 1
    return i
