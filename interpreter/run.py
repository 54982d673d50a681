"""Running programs: once (`run`), streamed, or many at once (`run_batch`)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING, Any

from plait.interpreter.executor import StreamExecutor
from plait.interpreter.state import ProgramState
from plait.lang.sampling import SamplingSpec

if TYPE_CHECKING:
    from plait.interpreter.backends.base import Backend
    from plait.lang.program import Program


def new_state(
    backend: Backend,
    program: Program,
    *,
    stream: bool = False,
    defaults: SamplingSpec | None = None,
) -> ProgramState:
    executor = StreamExecutor(
        backend,
        backend.chat_template(),
        defaults or SamplingSpec(),
        stream=stream,
        program_name=program.name,
    )
    return ProgramState(executor)


def execute(program: Program, state: ProgramState, arguments: dict[str, Any]) -> None:
    """Run the program body on `state` and wait for its nodes. On any error the state and its
    forks are cancelled (running model calls aborted) and the error is raised."""
    executor = state._executor
    executor.body_thread = threading.current_thread()
    try:
        program.invoke(state, arguments)
        executor.sync()
    except BaseException as exc:
        executor.cancel(exc)
        raise
    finally:
        executor.close()


def run_program(
    backend: Backend,
    program: Program,
    arguments: dict[str, Any],
    *,
    stream: bool,
    defaults: SamplingSpec,
) -> ProgramState:
    state = new_state(backend, program, stream=stream, defaults=defaults)
    if not stream:
        execute(program, state, arguments)
        return state

    def body() -> None:
        try:
            execute(program, state, arguments)
        except BaseException:  # recorded on the state; text_iter / text() raise it
            pass

    thread = threading.Thread(target=body, name=f"plait-{program.name}-body", daemon=True)
    state._executor.body_thread = thread  # before start: readers must wait for this body
    thread.start()
    return state


def run_program_batch(
    backend: Backend,
    program: Program,
    batch: list[dict[str, Any]],
    *,
    defaults: SamplingSpec,
    num_threads: int | str = "auto",
    progress_bar: bool = False,
) -> list[ProgramState]:
    """States in input order. The first program to fail cancels the others and is raised."""
    if not batch:
        return []
    if len(batch) > 1:
        precache(backend, program)
    states = [new_state(backend, program, defaults=defaults) for _ in batch]
    bar = _progress(len(batch)) if progress_bar else None
    with ThreadPoolExecutor(resolve_num_threads(num_threads, len(batch))) as pool:
        futures: dict[Future[None], int] = {
            pool.submit(execute, program, state, args): i
            for i, (state, args) in enumerate(zip(states, batch))
        }
        try:
            for future in as_completed(futures):
                future.result()
                if bar is not None:
                    bar.update(1)
        except BaseException:
            for f in futures:
                f.cancel()
            for state in states:
                state._executor.cancel()
            raise
        finally:
            if bar is not None:
                bar.close()
    return states


def precache(backend: Backend, program: Program) -> str:
    """Prefill the program's constant prefix once; returns it ("" when there is none)."""
    prefix = render_prefix(backend, program)
    if prefix:
        backend.cache_prefix(prefix)
    return prefix


def render_prefix(backend: Backend, program: Program) -> str:
    """The text every run of `program` starts with, rendered with the backend's template."""
    nodes = program.trace().prefix
    if not nodes:
        return ""
    executor = StreamExecutor(
        backend, backend.chat_template(), SamplingSpec(), program_name=program.name
    )
    for node in nodes:
        executor.run_inline(node)
    return executor.data.text


def resolve_num_threads(num_threads: int | str, batch_size: int) -> int:
    if num_threads == "auto":
        # NOTE: programs mostly wait on the model, and the engine batches whatever is live,
        # so many more threads than cores pay off.
        return max(1, min(batch_size, max(64, 8 * (os.cpu_count() or 1))))
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads: expected 'auto' or a positive integer, got {num_threads!r}")
    return min(num_threads, batch_size)


def _progress(total: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a convenience; tqdm is a plait dependency
        return None
    return tqdm(total=total)
