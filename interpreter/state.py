"""`ProgramState`: what a program appends to, and what `run` returns."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from plait.interpreter.executor import StreamExecutor
from plait.interpreter.state_data import ToolCall
from plait.lang.ir import as_node
from plait.lang.state import StateBase


class ProgramState(StateBase):
    """A program's running text, variables and messages.

    Appending (`s += ...`) returns at once; reading (`s["x"]`, `text()`) waits for the
    nodes it depends on and raises the error of a node that failed.
    """

    def __init__(self, executor: StreamExecutor) -> None:
        self._executor = executor

    def __iadd__(self, other: Any) -> ProgramState:
        self._executor.submit(as_node(other))
        return self

    def __repr__(self) -> str:
        ex = self._executor
        return (
            f"<ProgramState {ex.program_name} chars={len(ex.data.text)} "
            f"vars={sorted(ex.data.variables)}>"
        )

    # reading ----------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        """A variable's value: the text, or typed (dtype, pydantic model, parsed JSON)."""
        return self._executor.wait_var(name)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._executor.data.variables

    def get_var(self, name: str) -> Any:
        return self._executor.wait_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        with self._executor.write() as d:
            d.set_var(name, value)

    def var_text(self, name: str) -> str:
        """The text generated for variable `name` (also for typed variables)."""
        self._executor.wait_var(name)
        return self._executor.data.var_texts.get(name, "")

    def get_meta_info(self, name: str) -> Any:
        """The backend's `meta_info` for the call that set `name` (for select: the scores)."""
        self._executor.wait_var(name)
        return self._executor.data.meta_infos.get(name)

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._executor.data.variables)

    def text(self) -> str:
        self.sync()
        return self._executor.data.text

    def messages(self) -> list[dict[str, str]]:
        """Completed messages, `{"role", "content"}`, in order (an open one is left out)."""
        self.sync()
        return [dict(m) for m in self._executor.data.messages]

    @property
    def tool_calls(self) -> list[ToolCall]:
        self.sync()
        return list(self._executor.data.tool_calls)

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Text as it is generated: the whole state's, or only variable `name`'s.

        Ends when the program has finished (or `name` is complete); re-raises its error.
        """
        pos = 0
        while True:
            chunk, complete = self._executor.wait_stream(name, pos)
            pos += len(chunk)
            if chunk:
                yield chunk
            if complete:
                break
        self._executor.sync()

    def sync(self) -> None:
        """Wait for everything appended so far; raise the error of a failed node."""
        self._executor.sync()

    @property
    def error(self) -> BaseException | None:
        return self._executor.error

    # forks --------------------------------------------------------------------------------------

    def fork(self, n: int = 1) -> ForkGroup:
        """n branches that continue from this state's text; they run concurrently."""
        children = self._executor.fork(n)
        return ForkGroup(self, [ProgramState(c) for c in children])

    def join(self, forks: Sequence[ProgramState], mode: str = "gather_variable") -> None:
        """Wait for `forks`. `gather_variable`: each variable set in the branches becomes a
        list here (one entry per branch); `concat`: append each branch's new text."""
        self._executor.join([f._executor for f in forks], mode)


class ForkGroup(Sequence[ProgramState]):
    """The branches of `s.fork(n)`; `forks += node` appends to every branch."""

    def __init__(self, parent: ProgramState, states: list[ProgramState]) -> None:
        self.parent = parent
        self.states = states

    @overload
    def __getitem__(self, i: int) -> ProgramState: ...
    @overload
    def __getitem__(self, i: slice) -> list[ProgramState]: ...
    def __getitem__(self, i: int | slice) -> ProgramState | list[ProgramState]:
        return self.states[i]

    def __setitem__(self, i: int, state: ProgramState) -> None:
        # NOTE: `forks[i] += x` reassigns the (same) branch after `__iadd__`.
        if state is not self.states[i]:
            raise TypeError("fork branches cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, other: Any) -> ForkGroup:
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(
                    f"forks += list: got {len(other)} items for {len(self.states)} branches"
                )
            for state, item in zip(self.states, other):
                state += item
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        self.parent.join(self.states, mode)
