"""The program IR: immutable nodes that a program appends to its state.

Each node dispatches to exactly one method of a `NodeVisitor` (the interpreter), so adding a
node means adding one visitor method, never an `isinstance` ladder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from plait.lang.constraints import Constraint
from plait.lang.placeholder import Placeholder
from plait.lang.sampling import SamplingSpec
from plait.lang.tools import ToolSpec

SELECT_METHODS = ("token_length_normalized", "greedy_token", "unconditional_likelihood_normalized")


class NodeVisitor(Protocol):
    """What executes nodes; `plait.interpreter` implements it."""

    def visit_text(self, node: Text) -> None: ...
    def visit_gen(self, node: Gen) -> None: ...
    def visit_select(self, node: Select) -> None: ...
    def visit_role(self, node: Role) -> None: ...
    def visit_role_begin(self, node: RoleBegin) -> None: ...
    def visit_role_end(self, node: RoleEnd) -> None: ...
    def visit_concat(self, node: Concat) -> None: ...


class Node:
    """Base of every IR node; `a + b` of nodes and strings builds a `Concat`."""

    def accept(self, visitor: NodeVisitor) -> None:
        raise NotImplementedError

    def __add__(self, other: object) -> Concat:
        return Concat((*_parts(self), *_parts(as_node(other))))

    def __radd__(self, other: object) -> Concat:
        return Concat((*_parts(as_node(other)), *_parts(self)))

    @property
    def is_constant(self) -> bool:
        """True when the node's text is known before any model call (text, role markers)."""
        return False

    def leaves(self) -> tuple[Node, ...]:
        """The node as a flat sequence (roles become begin / body / end markers)."""
        return (self,)

    @property
    def writes(self) -> tuple[str, ...]:
        """The variables executing this node sets."""
        return tuple(name for leaf in self.leaves() if (name := leaf._own_var()) is not None)

    def _own_var(self) -> str | None:
        return None


@dataclass(frozen=True)
class Text(Node):
    value: str

    def accept(self, visitor: NodeVisitor) -> None:
        visitor.visit_text(self)

    @property
    def is_constant(self) -> bool:
        return True


@dataclass(frozen=True)
class Gen(Node):
    """Generate text into variable `name` (None: append only)."""

    name: str | None
    sampling: SamplingSpec
    constraint: Constraint | None = None
    tools: tuple[ToolSpec, ...] = ()
    max_tool_calls: int = 4

    def accept(self, visitor: NodeVisitor) -> None:
        visitor.visit_gen(self)

    def _own_var(self) -> str | None:
        return self.name


@dataclass(frozen=True)
class Select(Node):
    """Append the choice the model scores highest and store it in variable `name`."""

    name: str | None
    choices: tuple[str, ...]
    method: str = "token_length_normalized"

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError("select: choices is empty")
        if not all(isinstance(c, str) and c for c in self.choices):
            raise ValueError(
                f"select: every choice must be a non-empty string, got {list(self.choices)!r}"
            )
        if len(set(self.choices)) != len(self.choices):
            raise ValueError(f"select: choices contain duplicates: {list(self.choices)!r}")
        if self.method not in SELECT_METHODS:
            raise ValueError(
                f"select: method must be one of {', '.join(SELECT_METHODS)}, got {self.method!r}"
            )

    def accept(self, visitor: NodeVisitor) -> None:
        visitor.visit_select(self)

    def _own_var(self) -> str | None:
        return self.name


@dataclass(frozen=True)
class RoleBegin(Node):
    role: str

    def accept(self, visitor: NodeVisitor) -> None:
        visitor.visit_role_begin(self)

    @property
    def is_constant(self) -> bool:
        return True


@dataclass(frozen=True)
class RoleEnd(Node):
    role: str

    def accept(self, visitor: NodeVisitor) -> None:
        visitor.visit_role_end(self)

    @property
    def is_constant(self) -> bool:
        return True


@dataclass(frozen=True)
class Role(Node):
    """A whole message: `user("hi")` or `assistant(gen("answer"))`."""

    role: str
    body: tuple[Node, ...]

    def accept(self, visitor: NodeVisitor) -> None:
        visitor.visit_role(self)

    def leaves(self) -> tuple[Node, ...]:
        inner = tuple(leaf for part in self.body for leaf in part.leaves())
        return (RoleBegin(self.role), *inner, RoleEnd(self.role))


@dataclass(frozen=True)
class Concat(Node):
    parts: tuple[Node, ...]

    def accept(self, visitor: NodeVisitor) -> None:
        visitor.visit_concat(self)

    def leaves(self) -> tuple[Node, ...]:
        return tuple(leaf for part in self.parts for leaf in part.leaves())


def as_node(value: object) -> Node:
    """A node from a node or a string; anything else is a `TypeError` naming its type."""
    if isinstance(value, Node):
        return value
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, Placeholder):
        value._stop()
    raise TypeError(
        f"a program can only append strings and plait nodes (gen, select, user, ...), "
        f"got {type(value).__name__}; format it into a string first"
    )


def _parts(node: Node) -> tuple[Node, ...]:
    return node.parts if isinstance(node, Concat) else (node,)
