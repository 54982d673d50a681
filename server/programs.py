"""The program endpoint: `@program` functions registered at start-up (`--programs`), listed with
their parameters and run with JSON arguments on the server's own engine. No code is ever taken
over HTTP: only the registered programs run.

    GET  /programs                 -> {"programs": [{"name", "doc", "parameters": [...]}]}
    POST /programs/{name}          {"arguments": {...}, "sampling": {...}, "stream": false}
         -> {"program", "variables", "text", "messages"}
         stream: SSE events {"event": "variable_start" | "text" | "variable_end" | "done" | "error"}
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import sys
import threading
import typing
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic_core import to_jsonable_python

from plait.lang.program import Program
from plait.lang.sampling import SamplingSpec
from plait.server import calls
from plait.server.errors import APIError, bad_request, read_object
from plait.server.native import event_stream, sse, state_of

router = APIRouter()
_BODY = {"arguments", "sampling", "stream"}


def load_programs(specs: Iterable[str]) -> dict[str, Program]:
    """Every `Program` defined at the top level of each file (`path/to/file.py`) or module."""
    found: dict[str, Program] = {}
    for spec in specs:
        module = _import(spec)
        programs = {v.name: v for v in vars(module).values() if isinstance(v, Program)}
        if not programs:
            raise ValueError(f"programs: {spec!r} defines no @program functions")
        for name, prog in programs.items():
            if name in found and found[name] is not prog:
                raise ValueError(f"programs: two programs are named {name!r} (in {spec!r})")
            found[name] = prog
    return found


def _import(spec: str) -> Any:
    path = Path(spec)
    if spec.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ValueError(f"programs: no such file {spec!r}")
        name = f"plait_programs_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"programs: cannot load {spec!r}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(spec)
    except ImportError as e:
        raise ValueError(f"programs: cannot import module {spec!r}: {e}") from None


def describe(prog: Program) -> dict[str, Any]:
    params = []
    for p in prog.signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        entry: dict[str, Any] = {"name": p.name, "required": p.default is p.empty}
        if p.default is not p.empty:
            entry["default"] = to_jsonable_python(p.default, fallback=repr)
        if p.annotation is not p.empty:
            ann = p.annotation
            entry["annotation"] = (
                ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
            )
        params.append(entry)
    return {"name": prog.name, "doc": inspect.getdoc(prog.func) or "", "parameters": params}


@router.get("/programs")
async def list_programs(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {"programs": [describe(p) for _, p in sorted(state.programs.items())]}


def check_arguments(prog: Program, arguments: dict[str, Any]) -> dict[str, Any]:
    """Names against the signature, values against their annotations (pydantic, lax: `"3"` is
    not an int, but an int is a float); a 400 naming `arguments.<name>` otherwise."""
    from pydantic import TypeAdapter, ValidationError

    params = {n: p for n, p in prog.signature.parameters.items() if p.kind != p.VAR_POSITIONAL}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    try:
        hints = typing.get_type_hints(prog.func)
    except Exception:  # unresolvable annotations are not checked
        hints = {}
    checked = dict(arguments)
    for name, value in arguments.items():
        param = params.get(name)
        if param is None or param.kind == param.VAR_KEYWORD:
            if takes_any:
                continue
            known = ", ".join(n for n in params if n != "s") or "none"
            raise bad_request(f"arguments.{name}: not a parameter of {prog.name} ({known})")
        hint = hints.get(name)
        if hint is None:
            continue
        try:
            checked[name] = TypeAdapter(hint).validate_python(value)
        except ValidationError as e:
            detail = e.errors()[0].get("msg", "invalid value")
            raise bad_request(
                f"arguments.{name}: {detail}, got {json.dumps(value)[:100]}"
            ) from None
        except Exception:  # a type pydantic cannot check
            continue
    return checked


def jsonable(value: Any) -> Any:
    return to_jsonable_python(value, fallback=repr)


def _result(name: str, run: Any) -> dict[str, Any]:
    return {
        "program": name,
        "variables": jsonable(run.variables()),
        "text": run.text(),
        "messages": run.messages(),
    }


@router.post("/programs/{name}")
async def run_program(name: str, request: Request) -> Response:
    from plait.interpreter.run import run_program as start

    state = state_of(request)
    prog = state.programs.get(name)
    if prog is None:
        known = ", ".join(sorted(state.programs)) or "none are registered"
        raise APIError(404, f"program: no program named {name!r} ({known})", param="program")
    body = await read_object(request)
    unknown = sorted(set(body) - _BODY)
    if unknown:
        raise bad_request(f"{unknown[0]}: unknown field; the body takes {', '.join(sorted(_BODY))}")
    arguments = body.get("arguments") or {}
    sampling = body.get("sampling") or {}
    if not isinstance(arguments, dict):
        raise bad_request("arguments: expected an object of the program's parameters")
    if not isinstance(sampling, dict):
        raise bad_request("sampling: expected an object of gen() sampling arguments")
    arguments = check_arguments(prog, arguments)
    try:
        bound = prog.bind((), arguments)
    except TypeError as e:
        raise bad_request(f"arguments: {e}", "arguments") from None
    try:
        defaults = SamplingSpec.from_kwargs(sampling)
    except (TypeError, ValueError) as e:
        raise bad_request(f"sampling: {e}", "sampling") from None
    backend = state.backend
    # NOTE: a program's model calls are not counted by admission control (one run makes many).
    run = start(backend, prog, bound, stream=True, defaults=defaults)
    executor = run._executor
    if body.get("stream"):
        return event_stream(_events(state, name, run, request))
    waiter = asyncio.ensure_future(asyncio.to_thread(executor.body_thread.join))
    gone = asyncio.ensure_future(calls.wait_disconnect(request))
    done, _ = await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if waiter not in done:
        executor.cancel()
        state.metrics.program_runs.labels(name, "cancelled").inc()
        return Response(status_code=499)
    if run.error is not None:
        state.metrics.program_runs.labels(name, "error").inc()
        raise _program_error(name, run.error)
    state.metrics.program_runs.labels(name, "ok").inc()
    return JSONResponse(_result(name, run))


def _program_error(name: str, error: BaseException) -> APIError:
    return APIError(
        500, f"program {name!r} failed: {type(error).__name__}: {error}", type="program_error"
    )


async def _events(state: Any, name: str, run: Any, request: Request) -> AsyncIterator[bytes]:
    """Watches the running state in a thread and turns its changes into events."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    stop = threading.Event()

    def emit(event: dict[str, Any] | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    thread = threading.Thread(
        target=_watch, args=(run, emit, stop), name=f"plait-watch-{name}", daemon=True
    )
    thread.start()
    try:
        while True:
            event = await queue.get()
            if event is None:
                break
            yield sse(event)
        outcome = "error" if run.error is not None else "ok"
        state.metrics.program_runs.labels(name, outcome).inc()
        if run.error is not None:
            err = _program_error(name, run.error)
            yield sse({"event": "error", "message": err.message, "type": err.type})
        else:
            yield sse({"event": "done", **_result(name, run)})
        yield sse("[DONE]")
    finally:
        if thread.is_alive():  # the client went away: stop the program
            stop.set()
            run._executor.cancel()


def _watch(run: Any, emit: Any, stop: threading.Event) -> None:
    ex = run._executor
    sent_text = ""
    started: set[str] = set()
    ended: dict[str, Any] = {}
    while True:
        finished = not ex.body_thread.is_alive()
        with ex.cond:
            data = ex.data
            text, var_texts, variables = data.text, dict(data.var_texts), dict(data.variables)
        for var in var_texts:
            if var not in started:
                started.add(var)
                emit({"event": "variable_start", "name": var})
        if text != sent_text:
            common = 0
            limit = min(len(text), len(sent_text))
            while common < limit and text[common] == sent_text[common]:
                common += 1
            emit({"event": "text", "offset": common, "text": text[common:]})
            sent_text = text
        for var, value in variables.items():
            if var not in ended or ended[var] is not value:
                if var not in started:
                    started.add(var)
                    emit({"event": "variable_start", "name": var})
                ended[var] = value
                emit({"event": "variable_end", "name": var, "value": jsonable(value)})
        if finished or stop.is_set():
            emit(None)
            return
        with ex.cond:
            ex.cond.wait(timeout=0.05)
