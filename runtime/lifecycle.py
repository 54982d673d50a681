"""What the engine loop does besides stepping, so that every submitted request ends with a final
result: the inbox's messages (`handle`), deadlines (`timeout`), recovery from a step that raised
outside the forward pass, and failing what is left when the engine shuts down. Each ends requests
through the step applier's finish-and-deliver path (`StepApplier.end`), with an abort that carries
the HTTP status it stands for."""

from __future__ import annotations

import logging
import math
import queue
import time
from typing import TYPE_CHECKING, Any

from plait.runtime.protocol import FinishReason

if TYPE_CHECKING:
    from plait.runtime.engine_core import EngineCore
    from plait.runtime.request import Request

logger = logging.getLogger("plait.engine")

MAX_TIMEOUT = 7 * 24 * 3600.0


def check_timeout(timeout: Any) -> float | None:
    """A request's `timeout` in seconds (None: no deadline); ValueError naming it otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"timeout: expected a number of seconds, got {timeout!r}")
    if math.isnan(timeout) or not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout: must be in (0, {MAX_TIMEOUT:.0f}] seconds, got {timeout}")
    return float(timeout)


def handle(core: EngineCore, kind: str, item: Any) -> None:
    """One message from the engine's inbox (`EngineCore.post`): "add" (requests, each failing
    alone with a 400 or 500 where it cannot start), "abort" (a request id), "flush" (the prefix
    cache, when nothing runs) or "call" (a function run on the loop thread)."""
    if kind == "add":
        for req in item:
            core.totals["requests"] += 1
            core.totals["prompt_tokens"] += len(req.prompt_ids)
            try:
                core.processor.start(req)
                core.scheduler.add(req)
                if core.handoff is not None:  # pages imported for it stay until it is admitted
                    core.handoff.claim(req)
            except Exception as exc:
                status = 400 if isinstance(exc, ValueError) else 500
                core.applier.end(req, FinishReason("abort", message=str(exc), status_code=status))
    elif kind == "abort":
        req = core.scheduler.abort(item)
        if req is not None:
            core.applier.end(req, FinishReason("abort", message="aborted by the client"))
    elif kind == "flush":
        done, outcome = item
        ok = not core.scheduler.has_work()
        if ok:
            if core.handoff is not None:
                core.handoff.release_all()
            core.cache.reset()
        outcome.append(ok)
        done.set()
    elif kind == "call":
        fn, future = item
        try:
            future.set_result(fn())
        except Exception as exc:
            future.set_exception(exc)


def end(core: EngineCore, req: Request, message: str, status: int, keep: bool = True) -> None:
    """Takes `req` out of the scheduler (freeing its pages) and delivers it as aborted."""
    core.scheduler.abort(req.rid, keep=keep)
    core.applier.end(req, FinishReason("abort", message=message, status_code=status))


def expire(core: EngineCore) -> None:
    """Aborts every request whose deadline has passed (HTTP 504); ends the holds on imported
    KV whose request was admitted or never came."""
    if core.handoff is not None:
        core.handoff.expire()
    now = time.perf_counter()
    for req in core.scheduler.all_requests():
        if req.deadline is not None and now >= req.deadline:
            waited = now - req.arrival_time
            end(
                core,
                req,
                f"timeout: the request did not finish within its deadline "
                f"({waited:.1f} s since it arrived)",
                504,
            )


def recover(core: EngineCore, exc: BaseException) -> None:
    """A step raised outside the forward pass: its scheduling state cannot be trusted, so every
    request in it fails (500) and the engine carries on with an empty scheduler."""
    logger.exception("engine step failed; failing every running and waiting request")
    message = f"internal error: the engine step failed: {type(exc).__name__}: {exc}"
    for req in core.scheduler.all_requests():
        try:
            end(core, req, message, 500, keep=False)
        except Exception:  # keep failing the others
            logger.exception("could not fail request %s", req.rid)
    try:
        core.scheduler.check()
    except AssertionError:
        logger.critical("page accounting broken after a failed step; resetting the prefix cache")
        core.cache.reset()


def drain(core: EngineCore, inbox: queue.Queue[tuple[str, Any]]) -> None:
    """At shutdown: fails queued, waiting and running requests (503) instead of leaving their
    callers waiting forever."""
    message = "the engine shut down before the request finished"
    while True:
        try:
            kind, item = inbox.get_nowait()
        except queue.Empty:
            break
        if kind == "add":
            for req in item:
                core.applier.end(req, FinishReason("abort", message=message, status_code=503))
        elif kind == "flush":
            done, outcome = item
            outcome.append(False)
            done.set()
        elif kind == "call":
            item[1].set_exception(RuntimeError("Engine: shut down before the call ran"))
    for req in core.scheduler.all_requests():
        end(core, req, message, 503, keep=False)
