"""Tracing a program without a model, to find the text every run of it starts with.

The program runs against a `TracingState` that records what it appends; arguments not given
are `Placeholder`s. Tracing stops at the first thing that needs a model or an argument
(reading a variable, forking, formatting a placeholder), so what was recorded up to the first
non-constant node is the program's constant prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from plait.lang.ir import Node, as_node
from plait.lang.placeholder import Placeholder, TraceStop
from plait.lang.state import StateBase

__all__ = ["Placeholder", "Trace", "TraceStop", "TracingState"]


@dataclass(frozen=True)
class Trace:
    nodes: tuple[Node, ...]
    stopped_by: str | None = None  # why tracing ended early; None: the program ran to its end

    @property
    def prefix(self) -> tuple[Node, ...]:
        """The longest run of leading constant leaves (text and role markers)."""
        out: list[Node] = []
        for node in self.nodes:
            for leaf in node.leaves():
                if not leaf.is_constant:
                    return tuple(out)
                out.append(leaf)
        return tuple(out)


class TracingState(StateBase):
    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def __iadd__(self, other: Any) -> TracingState:
        self.nodes.append(as_node(other))
        return self

    def __getitem__(self, name: str) -> NoReturn:
        raise TraceStop(f"reads variable {name!r}")

    def __getattr__(self, name: str) -> NoReturn:
        raise TraceStop(f"calls state.{name}")
