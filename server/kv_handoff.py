"""Prefill–decode disaggregation, one server's part (`plait serve --role prefill|decode`).

The router splits a request in two halves (docs/scaling.md):

1. The **prefill half** goes to a `--role prefill` server, as the client sent it (not streamed)
   plus the header `X-Plait-KV-Handoff: <decode replica URL>`. The server checks and tokenizes
   it like any request, prefills each prompt without decoding it, and posts the prompts' KV
   (`KVRun`s: whole pages, checksummed) straight to that URL's `POST /kv/import`. It answers
   the router with what moved: `{"kv_handoff": {"tokens", "bytes", "prefill_ms", "push_ms",
   "imported_tokens", "error"}}`. A push that fails is reported in `error`, not raised: the decode
   replica then prefills the prompt itself.
2. The **decode half** is the request itself, sent to the `--role decode` server right after:
   its prompt is cached there but for the last token, whose logits give the first output token.

Only a `--role decode` server takes imports, and only a `--role prefill` server takes prefill
halves; `--role both` (the default) serves whole requests alone, as does every server for a
request without the header.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from plait.server.errors import APIError, bad_request, body_too_large

logger = logging.getLogger("plait.server")

ROLES = ("both", "prefill", "decode")
HANDOFF_HEADER = "x-plait-kv-handoff"
IMPORT_PATH = "/kv/import"
PUSH_TIMEOUT = httpx.Timeout(120.0, connect=5.0)
_IMPORT_SLACK_BYTES = 1 << 20  # token ids and headers beside the pages

router = APIRouter()


class HandedOff(Exception):
    """The prefill half of a request is done; its answer to the router (`summary`)."""

    def __init__(self, summary: dict[str, Any]) -> None:
        super().__init__(summary.get("error") or "handed off")
        self.summary = summary

    def response(self) -> JSONResponse:
        return JSONResponse({"kv_handoff": self.summary})


def handoff_target(state: Any, request: Request) -> str | None:
    """The decode replica a prefill half's KV goes to, or None for a whole request."""
    target = request.headers.get(HANDOFF_HEADER)
    if target is None:
        return None
    if state.config.role != "prefill":
        raise bad_request(
            f"{HANDOFF_HEADER}: this server's role is {state.config.role}; only a server started "
            "with --role prefill takes prefill halves",
            param=HANDOFF_HEADER,
        )
    if not target.startswith(("http://", "https://")):
        raise bad_request(f"{HANDOFF_HEADER}: expected an http(s) URL, got {target!r:.80}")
    return target.rstrip("/")


async def push(
    state: Any, prefilled: Any, target: str, auth: str | None, prefill_s: float
) -> HandedOff:
    """Posts the prefilled runs to `target`'s `/kv/import`; the answer for the router."""
    from plait.runtime.kv_tiers.handoff import encode_runs

    runs = prefilled.runs
    summary: dict[str, Any] = {
        "prompts": len(prefilled.outputs),
        "runs": len(runs),
        "tokens": sum(len(r.tokens) for r in runs),
        "bytes": sum(r.nbytes for r in runs),
        "prefill_ms": 1000 * prefill_s,
        "push_ms": 0.0,
        "imported_tokens": 0,
        "error": prefilled.error,
    }
    if not runs:
        return HandedOff(summary)

    async def body() -> AsyncIterator[bytes]:
        for part in encode_runs(runs):
            yield part  # type: ignore[misc]  # memoryviews go out as they are, uncopied

    headers = {"content-type": "application/octet-stream"}
    if auth:
        headers["authorization"] = auth
    started = time.perf_counter()
    if state.push_client is None:  # one per server: a client is costly to make (TLS setup)
        state.push_client = httpx.AsyncClient(timeout=PUSH_TIMEOUT)
    try:
        reply = await state.push_client.post(target + IMPORT_PATH, content=body(), headers=headers)
        if reply.status_code == 200:
            result = reply.json()
            summary["imported_tokens"] = result["tokens"]
            if result["failures"]:
                summary["error"] = "; ".join(result["failures"])
        else:
            summary["error"] = (
                f"{target}{IMPORT_PATH} answered {reply.status_code}: {reply.text[:300]}"
            )
    except httpx.HTTPError as exc:
        summary["error"] = f"{target}{IMPORT_PATH}: {type(exc).__name__}: {exc}"
    summary["push_ms"] = 1000 * (time.perf_counter() - started)
    if summary["error"]:
        logger.warning("kv handoff to %s: %s (it prefills there)", target, summary["error"])
    return HandedOff(summary)


@router.post(IMPORT_PATH)
async def kv_import(request: Request) -> JSONResponse:
    """Caches pushed runs for the requests that follow (a `--role decode` server)."""
    state = request.app.state.plait
    if state.config.role != "decode":
        raise APIError(
            404,
            f"{IMPORT_PATH}: this server's role is {state.config.role}; only a server "
            "started with --role decode takes KV",
        )
    limit = state.pool_tokens * state.engine.stats()["kv_bytes_per_token"] + _IMPORT_SLACK_BYTES
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise body_too_large(limit)
    try:
        result = await state.engine.handoff.async_import_runs(memoryview(data))
    except ValueError as exc:
        raise bad_request(str(exc), param="body") from None
    return JSONResponse(result.as_dict())


def install_kv_handoff(app: FastAPI) -> None:
    """`/kv/import` and the answer to prefill halves; checks at start that the engine can hand
    KV off when the server has a role."""
    state = app.state.plait
    if state.config.role != "both":
        state.engine.core.kv_handoff()  # a ValueError if the engine cannot (tp, no radix cache)
    app.include_router(router)

    @app.exception_handler(HandedOff)
    async def _handed_off(request: Request, exc: HandedOff) -> JSONResponse:
        return exc.response()
