"""What a program's first parameter is: the base every state (real or tracing) shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from plait.lang.ir import RoleBegin, RoleEnd


class StateBase(ABC):
    """A program appends with `s += node_or_text`; roles also work as context managers."""

    @abstractmethod
    def __iadd__(self, other: Any) -> StateBase: ...

    @contextmanager
    def role(self, name: str) -> Iterator[StateBase]:
        """`with s.role("tool"): s += "..."`: everything appended inside is one message."""
        state: StateBase = self
        state += RoleBegin(name)
        yield state
        state += RoleEnd(name)

    def system(self) -> Any:
        return self.role("system")

    def user(self) -> Any:
        return self.role("user")

    def assistant(self) -> Any:
        return self.role("assistant")
