"""The dashboard's requests panel: who submitted each engine request, and a summary of it.

`RequestLog` subscribes to the engine's `RequestSubmitted` events (one per submitted request, never
per step, emitted on the submitting thread) to name each request after the route that made it
(`RouteLabel`, an ASGI middleware, puts the path in a context variable) or the program whose
thread made it, and keeps the last submitted requests so recently finished ones can be shown. Prompt
text is only ever decoded when the server allows it (`show_prompts`).
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from plait.runtime.events import RequestSubmitted
from plait.server.dashboard_probe import subscribe_weakly

MAX_LABELS = 8192
MAX_RECENT = 128
PROMPT_PREVIEW_TOKENS = 48
_CONSTRAINTS = ("json_schema", "regex", "ebnf", "lark", "grammar", "choices", "structural_tag")
_OWN_THREADS = ("plait-engine", "plait-uvicorn", "plait-load")

route_path: contextvars.ContextVar[str | None] = contextvars.ContextVar("plait_route", default=None)


class RouteLabel:
    """Pure ASGI: sets `route_path` for the request's task (one context variable per request)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = route_path.set(scope["path"])
        try:
            await self.app(scope, receive, send)
        finally:
            route_path.reset(token)


def current_label() -> str:
    """`chat`, `completions`, `generate`, `program:NAME`, or `python` (an in-process caller)."""
    path = route_path.get()
    if path is not None:
        if path.startswith("/programs/"):
            return "program:" + path.removeprefix("/programs/")
        return {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(
            path, path.strip("/") or "/"
        )
    name = threading.current_thread().name
    if name.startswith("plait-") and name not in _OWN_THREADS:
        return "program:" + name.removeprefix("plait-").removesuffix("-body")
    return "python"


class RequestLog:
    """One per engine (servers that share an engine share it). Lives as long as the engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.labels: OrderedDict[str, str] = OrderedDict()
        self.recent: deque[Any] = deque(maxlen=MAX_RECENT)
        self._subscription = subscribe_weakly(engine, self._submitted, (RequestSubmitted,))

    def _submitted(self, event: RequestSubmitted) -> None:
        labels = self.labels
        labels[event.rid] = current_label()
        self.recent.append(event.request)
        while len(labels) > MAX_LABELS:
            labels.popitem(last=False)

    # summaries (event loop) -------------------------------------------------------------------

    def live(self, show_prompts: bool = False) -> list[dict[str, Any]]:
        """Every request the scheduler holds, plus submitted ones it has not taken in yet."""
        now = time.perf_counter()
        held = self.engine.core.scheduler.requests_by_state()
        seen = {id(req) for _, req in held}
        out = [self.summary(req, state, now, show_prompts) for state, req in held]
        for req in copy_list(self.recent):
            if id(req) not in seen and not req.finished:
                out.append(self.summary(req, "submitted", now, show_prompts))
        return out

    def finished(
        self, extra: Iterable[Any] = (), limit: int = 32, show_prompts: bool = False
    ) -> list[dict[str, Any]]:
        """The last finished requests, newest first (`extra`: more the caller saw finish)."""
        now = time.perf_counter()
        done = {id(r): r for r in [*copy_list(self.recent), *extra] if r.finished}
        newest = sorted(done.values(), key=lambda r: r.finish_time or 0.0, reverse=True)
        return [self.summary(r, "finished", now, show_prompts) for r in newest[:limit]]

    def summary(
        self, req: Any, status: str, now: float, show_prompts: bool = False
    ) -> dict[str, Any]:
        spec = req.spec
        end = req.finish_time if req.finish_time is not None else now
        reason = req.finish_reason
        out: dict[str, Any] = {
            "rid": req.rid,
            "label": self.labels.get(req.rid, "python"),
            "status": status,
            "client": req.client_id or None,
            "prompt_tokens": len(req.prompt_ids),
            "cached_tokens": req.cached_tokens,
            "generated_tokens": len(req.output_ids),
            "max_new_tokens": req.sampling.params.max_new_tokens,
            "constraint": constraint_kind(req),
            "jump_forward_tokens": req.constraint.jump_forward_tokens,
            "spec_proposed": spec.num_proposed,
            "spec_accepted": spec.num_accepted,
            "spec_acceptance": spec.num_accepted / spec.num_proposed if spec.num_proposed else None,
            "age_s": end - req.arrival_time,
            "ttft_s": None
            if req.first_token_time is None
            else req.first_token_time - req.arrival_time,
            "finish_reason": None if reason is None else reason.type,
            "finish_detail": None if reason is None else _detail(reason),
        }
        if show_prompts:
            out["prompt"] = self._preview(req.prompt_ids)
        return out

    def _preview(self, ids: list[int]) -> str:
        head = self.engine.tokenizer.decode(ids[:PROMPT_PREVIEW_TOKENS])
        return head + ("…" if len(ids) > PROMPT_PREVIEW_TOKENS else "")


def constraint_kind(req: Any) -> str | None:
    params = req.sampling.params
    for name in _CONSTRAINTS:
        if getattr(params, name, None) is not None:
            return name
    return None if req.constraint.grammar is None else "grammar"


def _detail(reason: Any) -> str | None:
    if reason.type == "stop":
        return None if reason.matched is None else str(reason.matched)
    if reason.type == "length":
        return None if reason.length is None else str(reason.length)
    code = f"{reason.status_code}: " if reason.status_code is not None else ""
    return code + (reason.message or "")


def copy_list(items: Iterable[Any]) -> list[Any]:
    """A list of a container the engine thread may be changing (retried if it changed)."""
    for _ in range(3):
        try:
            return list(items)
        except RuntimeError:
            continue
    return []
