"""Engine calls on behalf of HTTP requests: admission (503 when full), request ids, deadlines
(the server's default `timeout`), whose request it is (for fair scheduling), aborting when the
client goes away, and feeding the metrics.

A route builds the `async_generate` keyword arguments; `generate` returns the native result(s),
`stream` yields the engine's cumulative chunks. Both abort every engine request they started if
the client disconnects or the caller stops early, so its KV pages are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from plait.runtime.protocol import MAX_SAMPLES
from plait.server import kv_handoff
from plait.server.errors import bad_request, from_value_error, queue_full
from plait.server.metrics import StreamTimer

if TYPE_CHECKING:
    from plait.server.state import ServerState


class ClientGone(Exception):
    """The client disconnected before its result was ready."""


class Admission:
    """Counts engine requests in flight; refuses new ones past `limit` (None: no limit).

    Also remembers which engine requests each client-visible rid stands for (a prompt with
    `n` samples is n engine requests), so `/abort_request` can stop all of them.
    """

    def __init__(self, limit: int | None, retry_after: int = 1) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.in_flight = 0
        self.live: dict[str, list[str]] = {}

    @contextlib.contextmanager
    def admit(self, rids: str | list[str], n: int) -> Iterator[list[str]]:
        """Yields the engine's ids for these requests."""
        prompts = rids if isinstance(rids, list) else [rids]
        busy = [r for r in prompts if r in self.live]
        if busy or len(set(prompts)) != len(prompts):
            raise bad_request(
                f"rid: {(busy or prompts)[0]!r} is already in use by a running request", "rid"
            )
        count = len(prompts) * n
        # NOTE: single-threaded (the event loop), so check-then-add needs no lock.
        if self.limit is not None and self.in_flight + count > self.limit:
            raise queue_full(self.limit, self.retry_after)
        self.in_flight += count
        mapping = {r: [f"{r}-{i}" for i in range(n)] if n > 1 else [r] for r in prompts}
        self.live.update(mapping)
        try:
            yield [e for r in prompts for e in mapping[r]]
        finally:
            self.in_flight -= count
            for r in prompts:
                self.live.pop(r, None)

    def engine_rids(self, rid: str) -> list[str]:
        return self.live.get(rid, [rid])


def assign_rids(rid: Any, num_prompts: int, batched: bool) -> str | list[str]:
    """One id per prompt (the engine appends `-i` for the n samples of each)."""
    if rid is None:
        base = uuid.uuid4().hex
        return [f"{base}-p{i}" for i in range(num_prompts)] if batched else base
    if batched and isinstance(rid, str):
        return [f"{rid}-p{i}" for i in range(num_prompts)]
    return rid


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Any) -> Any:
    """Awaits `awaitable` unless the client leaves first: then it is cancelled (the engine's
    calls abort their requests when cancelled) and `ClientGone` is raised."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientGone()
    return task.result()


CLIENT_HEADER = "x-client-id"
_MAX_CLIENT_ID = 128


def client_of(request: Request, user: str | None = None) -> str:
    """Whom a request is for: the `X-Client-Id` header, else the body's `user` (OpenAI), else
    the peer address."""
    given = request.headers.get(CLIENT_HEADER) or user
    if given:
        return "id:" + given[:_MAX_CLIENT_ID]
    return "addr:" + (request.client.host if request.client else "unknown")


def _prepare(state: ServerState, request: Request, kwargs: dict[str, Any]) -> None:
    """The server's defaults for what the request leaves out."""
    if kwargs.get("timeout") is None:
        kwargs["timeout"] = state.config.request_timeout
    if state.config.closed_finish_reason != "length":
        params = kwargs.get("sampling_params")
        kwargs["sampling_params"] = (
            [_closed_as(p, state) for p in params]
            if isinstance(params, list)
            else _closed_as(params, state)
        )
    if kwargs.get("client_id") is None:
        kwargs["client_id"] = client_of(request)


def token_budget(
    state: ServerState,
    prompt_len: int,
    requested: int | None,
    prompt: str,
    field: str = "max_tokens",
) -> int:
    """The output tokens a request gets: `requested`, or all that the context (and the KV pool)
    holds after its prompt when None. A prompt or a `requested` that does not fit is a 400
    naming `prompt` or `field`."""
    limit = min(state.engine.context_len, state.pool_tokens)
    if prompt_len >= limit:
        raise bad_request(
            f"{prompt}: the prompt has {prompt_len} tokens, but the model's context length is "
            f"{limit} (prompt + output must fit)",
            prompt,
        )
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise bad_request(
            f"{field}: the prompt ({prompt_len} tokens) plus {field} ({requested}) exceeds the "
            f"model's context length ({limit})",
            field,
        )
    return requested


def _closed_as(params: Any, state: ServerState) -> Any:
    if params is None:
        params = {}
    if not isinstance(params, dict) or params.get("closed_finish_reason") is not None:
        return params  # the request's own choice (or a malformed body, for the engine to refuse)
    return {**params, "closed_finish_reason": state.config.closed_finish_reason}


def _samples(kwargs: dict[str, Any]) -> int:
    """The largest `n` of the call's sampling params. Checked here, before admission builds an
    id per sample: a huge `n` must be a 400, not a list of a billion ids."""
    params = kwargs.get("sampling_params") or {}
    found = [1]
    for p in params if isinstance(params, list) else [params]:
        n = p.get("n") if isinstance(p, dict) else None
        if n is None:
            continue
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
            raise bad_request(f"n: must be an integer in [1, {MAX_SAMPLES}], got {n!r}", "n")
        found.append(n)
    return max(found)


async def generate(
    state: ServerState,
    request: Request,
    endpoint: str,
    rename: dict[str, str] | None = None,
    **kwargs: Any,
) -> dict | list[dict]:
    """The native result(s); ValueError -> 400 (`rename`: see `from_value_error`); a disconnect
    aborts and raises `ClientGone`."""
    _prepare(state, request, kwargs)
    target = kv_handoff.handoff_target(state, request)
    if target is not None:
        raise await _prefill_half(state, request, target, rename, kwargs)
    with state.admission.admit(kwargs["rid"], _samples(kwargs)):
        try:
            out = await until_disconnect(request, state.engine.async_generate(**kwargs))
        except ValueError as e:
            raise from_value_error(e, rename=rename) from None
    for o in out if isinstance(out, list) else [out]:
        state.metrics.observe_finished(endpoint, o["meta_info"])
    return out


async def stream(
    state: ServerState,
    request: Request,
    endpoint: str,
    rename: dict[str, str] | None = None,
    **kwargs: Any,
) -> AsyncIterator[dict]:
    """Starts the call (raising a 400 or 503 before the first chunk) and returns its chunks."""
    start = time.perf_counter()
    _prepare(state, request, kwargs)
    target = kv_handoff.handoff_target(state, request)
    if target is not None:
        raise await _prefill_half(state, request, target, rename, kwargs)
    admitted = state.admission.admit(kwargs["rid"], _samples(kwargs))
    rids = admitted.__enter__()
    try:
        chunks = await state.engine.async_generate(stream=True, **kwargs)
    except BaseException as e:
        admitted.__exit__(None, None, None)
        if isinstance(e, ValueError):
            raise from_value_error(e, rename=rename) from None
        raise
    release = _Release(state, rids, admitted)
    relay = _relay(state, request, endpoint, chunks, release, start)
    # NOTE: a response that is dropped before its first chunk never enters `_relay`'s finally.
    weakref.finalize(relay, release)
    return relay


async def _prefill_half(
    state: ServerState,
    request: Request,
    target: str,
    rename: dict[str, str] | None,
    kwargs: dict[str, Any],
) -> kv_handoff.HandedOff:
    """A request's prefill half (`--role prefill`): its prompts prefilled, their KV sent to the
    decode replica at `target` (server/kv_handoff.py)."""
    started = time.perf_counter()
    with state.admission.admit(kwargs["rid"], 1):
        try:
            prefill = state.engine.handoff.async_prefill(**kwargs)
            prefilled = await until_disconnect(request, prefill)
        except ValueError as e:
            raise from_value_error(e, rename=rename) from None
    auth = request.headers.get("authorization")
    return await kv_handoff.push(state, prefilled, target, auth, time.perf_counter() - started)


class _Release:
    """Idempotent end of a streamed call: abort what is unfinished, leave admission."""

    def __init__(self, state: ServerState, rids: list[str], admitted: Any) -> None:
        self.state, self.rids, self.admitted = state, rids, admitted
        self.finished = 0
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        if self.finished < len(self.rids):
            for rid in self.rids:
                self.state.engine.abort(rid)
        self.admitted.__exit__(None, None, None)


async def _relay(
    state: ServerState,
    request: Request,
    endpoint: str,
    chunks: AsyncIterator[dict],
    release: _Release,
    start: float,
) -> AsyncIterator[dict]:
    timers: dict[int, StreamTimer] = {}

    async def watch() -> None:
        await wait_disconnect(request)
        for rid in release.rids:
            state.engine.abort(rid)

    watcher = asyncio.ensure_future(watch())
    try:
        async for chunk in chunks:
            index = chunk.get("index", 0)
            meta = chunk["meta_info"]
            timers.setdefault(index, state.metrics.stream_timer(start)).tick(
                meta["completion_tokens"], time.perf_counter()
            )
            if meta.get("finish_reason") is not None:
                release.finished += 1
                state.metrics.observe_finished(endpoint, meta)
            yield chunk
    finally:
        watcher.cancel()
        release()
