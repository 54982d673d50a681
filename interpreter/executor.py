"""`StreamExecutor`: one program state's data, and the worker thread that runs its nodes.

`s += node` only queues the node, so the program body runs ahead until it reads a result;
that is what lets the branches of a fork (each its own executor) call the model at once.
All state data is written by the worker under `cond`; readers wait on `cond`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import uuid
from collections import Counter, deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from plait.interpreter.errors import ProgramCancelled
from plait.interpreter.interpret import Interpreter
from plait.interpreter.state_data import StateData
from plait.lang.ir import Node
from plait.lang.sampling import SamplingSpec

if TYPE_CHECKING:
    from plait.interpreter.backends.base import Backend
    from plait.interpreter.chat_template import ChatTemplate

# frames skipped when finding the program line that appended a node
_OUR_FILES = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (__file__, sys.modules[SamplingSpec.__module__].__file__ or "")
) + (contextlib.__file__,)


class StreamExecutor:
    """Runs one state's nodes in order on a worker thread (started on demand, gone when idle);
    tracks its running model calls so a failure can abort them, and the forks made from it."""

    def __init__(
        self,
        backend: Backend,
        template: ChatTemplate,
        defaults: SamplingSpec,
        *,
        stream: bool = False,
        program_name: str = "<state>",
        data: StateData | None = None,
    ) -> None:
        self.backend = backend
        self.template = template
        self.defaults = defaults
        self.stream = stream
        self.program_name = program_name
        self.data = data or StateData()
        self.fork_point = len(self.data.text)
        self.fork_tool_calls = len(self.data.tool_calls)
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.closed = False  # the program returned: no more nodes will come
        self.body_thread: threading.Thread | None = None  # the thread running the program body
        self.children: list[StreamExecutor] = []
        self._queue: deque[tuple[Node, str]] = deque()
        self._pending = 0
        self._pending_vars: Counter[str] = Counter()
        self._worker_running = False
        self._rids: set[str] = set()
        self._interpreter = Interpreter(self)

    # submitting and waiting -----------------------------------------------------------------

    def submit(self, node: Node) -> None:
        origin = _caller()
        with self.cond:
            self._raise_if_failed()
            self._queue.append((node, origin))
            self._pending += 1
            self._pending_vars.update(node.writes)
            if not self._worker_running:
                self._worker_running = True
                threading.Thread(
                    target=self._work, name=f"plait-{self.program_name}", daemon=True
                ).start()

    def _work(self) -> None:
        while True:
            with self.cond:
                if not self._queue:
                    self._worker_running = False
                    self.cond.notify_all()
                    return
                node, origin = self._queue.popleft()
            try:
                node.accept(self._interpreter)
            except BaseException as exc:
                self.fail(exc, origin)
            finally:
                with self.cond:
                    self._pending -= 1
                    self._pending_vars.subtract(node.writes)
                    self.cond.notify_all()

    def run_inline(self, node: Node) -> None:
        """Execute `node` in the calling thread (for nodes that never call the model)."""
        node.accept(self._interpreter)

    def _settled(self) -> bool:
        """Nothing more will arrive for the caller: all queued nodes ran, and either the program
        returned or the caller is the program body itself (which cannot wait for itself)."""
        if self._pending:
            return False
        return self.closed or self.body_thread in (None, threading.current_thread())

    def sync(self) -> None:
        """Wait until every node ran; raise the state's error if it has one. Outside the program
        body (a streamed run) this also waits for the body to return."""
        with self.cond:
            self.cond.wait_for(lambda: self._settled() or self.error is not None)
            self._raise_if_failed()

    def wait_var(self, name: str) -> Any:
        def ready() -> bool:
            done = name in self.data.variables and self._pending_vars[name] <= 0
            return done or self._settled() or self.error is not None

        with self.cond:
            self.cond.wait_for(ready)
            self._raise_if_failed()
            if name not in self.data.variables:
                known = ", ".join(sorted(self.data.variables)) or "none"
                raise KeyError(f"variable {name!r} was never set (variables: {known})")
            return self.data.variables[name]

    def wait_stream(self, name: str | None, pos: int) -> tuple[str, bool]:
        """Text after `pos` (of the state, or of variable `name`) once there is some; and
        whether that text is complete."""

        def current() -> str:
            return self.data.text if name is None else self.data.var_texts.get(name, "")

        def complete() -> bool:
            if self.error is not None or (self.closed and self._pending == 0):
                return True
            return (
                name is not None and name in self.data.variables and self._pending_vars[name] <= 0
            )

        with self.cond:
            self.cond.wait_for(lambda: len(current()) > pos or complete())
            return current()[pos:], complete()

    # failure and cancellation -----------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def fail(self, exc: BaseException, origin: str = "") -> None:
        """Record the first error, drop queued nodes and abort the running model call."""
        with self.cond:
            if self.error is None:
                if origin and hasattr(exc, "add_note"):
                    exc.add_note(f"in program {self.program_name!r}, at {origin}")
                self.error = exc
            self._pending -= len(self._queue)
            for node, _ in self._queue:
                self._pending_vars.subtract(node.writes)
            self._queue.clear()
            rids = list(self._rids)
            self.cond.notify_all()
        for rid in rids:
            try:
                self.backend.abort(rid)
            except Exception:  # best effort: the call fails or finishes by itself
                pass

    def cancel(self, reason: BaseException | None = None) -> None:
        """Stop this state and every fork of it."""
        self.fail(reason or ProgramCancelled(f"program {self.program_name!r} was cancelled"))
        for child in list(self.children):
            child.cancel(reason)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for child in list(self.children):
            child.close()

    # model calls in flight (so they can be aborted) -------------------------------------------

    def track(self, *rids: str) -> None:
        with self.cond:
            self._raise_if_failed()
            self._rids.update(rids)

    def untrack(self, *rids: str) -> None:
        with self.cond:
            self._rids.difference_update(rids)

    # forks ------------------------------------------------------------------------------------

    def fork(self, n: int) -> list[StreamExecutor]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"fork: n must be a positive integer, got {n!r}")
        self.sync()
        if n > 1 and self.data.text:
            rid = uuid.uuid4().hex
            self.track(rid)
            try:
                self.backend.cache_prefix(self.data.text, rid=rid)
            finally:
                self.untrack(rid)
        children = [
            StreamExecutor(
                self.backend,
                self.template,
                self.defaults,
                stream=self.stream,
                program_name=self.program_name,
                data=self.data.copy(),
            )
            for _ in range(n)
        ]
        for child in children:
            child.body_thread = self.body_thread
        with self.cond:
            self.children.extend(children)
        return children

    def join(self, children: list[StreamExecutor], mode: str) -> None:
        if mode not in ("gather_variable", "concat"):
            raise ValueError(f"join: mode must be 'gather_variable' or 'concat', got {mode!r}")
        for child in children:
            child.sync()
        self.sync()
        with self.cond:
            if mode == "gather_variable":
                names = sorted(set().union(*(c.data.written for c in children)))
                for name in names:
                    self.data.variables[name] = [c.data.variables.get(name) for c in children]
                    self.data.meta_infos[name] = [c.data.meta_infos.get(name) for c in children]
                    self.data.written.add(name)
            else:
                for c in children:
                    self.data.text += c.data.text[c.fork_point :]
            for c in children:
                self.data.tool_calls.extend(c.data.tool_calls[c.fork_tool_calls :])
            self.cond.notify_all()

    # writing the state ------------------------------------------------------------------------

    @contextlib.contextmanager
    def write(self) -> Iterator[StateData]:
        """The state's data, locked; readers wake when the block ends."""
        with self.cond:
            yield self.data
            self.cond.notify_all()


def _caller() -> str:
    """The first frame outside plait's language and interpreter: the program's line."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OUR_FILES):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
