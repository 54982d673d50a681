"""`@program`: an ordinary Python function whose first parameter is the state.

`lang` does not execute anything: `run` / `run_batch` hand the program to a backend, which
implements the `Runner` protocol (every `plait.interpreter` backend does).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from plait.lang.context import get_default_backend
from plait.lang.sampling import SamplingSpec
from plait.lang.state import StateBase
from plait.lang.trace import Placeholder, Trace, TraceStop, TracingState

_SAMPLING_NAMES = frozenset(SamplingSpec.field_names()) | {"max_new_tokens", "min_new_tokens"}


class Runner(Protocol):
    """What `Program.run` needs from a backend."""

    def run_program(
        self, program: Program, arguments: dict[str, Any], *, stream: bool, defaults: SamplingSpec
    ) -> Any: ...

    def run_program_batch(
        self,
        program: Program,
        batch: list[dict[str, Any]],
        *,
        defaults: SamplingSpec,
        num_threads: int | str,
        progress_bar: bool,
    ) -> list[Any]: ...


class Program:
    """A decorated program. Call it with a state inside another program to run it inline."""

    def __init__(self, func: Callable[..., Any]) -> None:
        if not callable(func):
            raise TypeError(f"@program: expected a function, got {type(func).__name__}")
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (
            params[0].POSITIONAL_ONLY,
            params[0].POSITIONAL_OR_KEYWORD,
        ):
            raise TypeError(f"@program {func.__name__}: the first parameter must be the state (s)")
        self.func = func
        self.name: str = func.__name__
        self.signature = inspect.Signature(params[1:])
        functools.update_wrapper(self, func)

    def __repr__(self) -> str:
        return f"<program {self.name}{self.signature}>"

    @property
    def parameters(self) -> tuple[str, ...]:
        return tuple(self.signature.parameters)

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, StateBase):
            raise TypeError(
                f"program {self.name}: call {self.name}.run(...) to run it; inside another "
                f"program call it as {self.name}(s, ...) with that program's state"
            )
        return self.func(state, *args, **kwargs)

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The program's arguments by name, defaults applied; `TypeError` names a bad one."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"program {self.name}: {e}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def invoke(self, state: StateBase, arguments: dict[str, Any]) -> Any:
        """Call the function with `arguments` as `bind` returns them."""
        bound = inspect.BoundArguments(self.signature, arguments)  # type: ignore[arg-type]
        return self.func(state, *bound.args, **bound.kwargs)

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], SamplingSpec]:
        # NOTE: a program parameter named like a sampling field (e.g. `temperature`) wins.
        program_kwargs = {k: v for k, v in kwargs.items() if k in self.signature.parameters}
        sampling = {k: v for k, v in kwargs.items() if k not in program_kwargs}
        unknown = sorted(set(sampling) - _SAMPLING_NAMES)
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in self.signature.parameters.values()):
            raise TypeError(
                f"program {self.name}: unexpected argument(s) {', '.join(unknown)}; its "
                f"parameters are {', '.join(self.parameters) or '(none)'}"
            )
        for k in unknown:
            program_kwargs[k] = sampling.pop(k)
        return program_kwargs, SamplingSpec.from_kwargs(sampling)

    def run(self, *args: Any, backend: Any = None, stream: bool = False, **kwargs: Any) -> Any:
        """Run once; returns the `ProgramState`. Keyword arguments named like `gen`'s sampling
        arguments (max_tokens, temperature, ...) are defaults for every `gen` in the program."""
        program_kwargs, defaults = self._split(kwargs)
        arguments = self.bind(args, program_kwargs)
        runner: Runner = backend if backend is not None else get_default_backend()
        return runner.run_program(self, arguments, stream=stream, defaults=defaults)

    def run_batch(
        self,
        batch: Sequence[dict[str, Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        **sampling: Any,
    ) -> list[Any]:
        """Run once per argument dict, concurrently; states come back in input order."""
        if isinstance(batch, dict) or not all(isinstance(b, dict) for b in batch):
            raise TypeError(f"program {self.name}: run_batch takes a list of argument dicts")
        _, defaults = self._split(sampling)
        arguments = [self.bind((), dict(b)) for b in batch]
        runner: Runner = backend if backend is not None else get_default_backend()
        return runner.run_program_batch(
            self, arguments, defaults=defaults, num_threads=num_threads, progress_bar=progress_bar
        )

    def trace(self, *args: Any, **kwargs: Any) -> Trace:
        """Run without a model; arguments not given stay unknown. See `Trace.prefix`."""
        try:
            bound = self.signature.bind_partial(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"program {self.name}: {e}") from None
        bound.apply_defaults()
        arguments = {
            name: bound.arguments.get(name, Placeholder(name))
            for name, p in self.signature.parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        state = TracingState()
        try:
            self.invoke(state, arguments)
        except TraceStop as stop:
            return Trace(tuple(state.nodes), str(stop))
        except Exception as e:  # anything else also ends what we can know without a model
            return Trace(tuple(state.nodes), f"{type(e).__name__}: {e}")
        return Trace(tuple(state.nodes))


def program(func: Callable[..., Any]) -> Program:
    """Decorator: `@program def f(s, ...): s += ...`."""
    return Program(func)
