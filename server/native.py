"""SGLang's native protocol, as `sglang.RuntimeEndpoint` uses it (docs/server.md; its place in
the layers: docs/architecture.md, "Protocols")."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from plait.server import calls
from plait.server.errors import APIError, bad_request, from_abort, read_object
from plait.server.state import PLAIT_VERSION, ServerState

router = APIRouter()
logger = logging.getLogger("plait.server")

_FIELDS = {
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "rid",
    "timeout",
}
# SGLang fields this server does not implement: accepted only when they ask for nothing.
_INERT = {
    "image_data",
    "audio_data",
    "video_data",
    "modalities",
    "lora_path",
    "session_params",
    "custom_logit_processor",
    "return_hidden_states",
    "input_embeds",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "data_parallel_rank",
    "log_metrics",
    "stream_output",
    "token_ids_logprob",
    "priority",
    "no_logs",
}
_TOLERATED = {"log_metrics", "no_logs", "stream_output"}  # any value is fine
MAX_PROMPTS = 1024  # per request; each becomes an engine request (times n)


def sse(payload: Any) -> bytes:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def event_stream(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        terminated(chunks), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def terminated(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Every stream ends with `data: [DONE]`, after an error event if producing it failed."""
    done = sse("[DONE]")
    finished = False
    try:
        async for chunk in chunks:
            finished = chunk == done
            yield chunk
    except Exception as exc:  # a bug or a failure mid-stream: tell the client, then end
        logger.exception("stream failed")
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        yield sse({"error": {"message": error.message, "type": error.type, "code": 500}})
    if not finished:
        yield done


def state_of(request: Request) -> ServerState:
    return request.app.state.plait


def check_generate_body(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - _FIELDS - _INERT)
    if unknown:
        raise bad_request(
            f"{unknown[0]}: unknown field(s) {', '.join(unknown)}; /generate takes "
            f"{', '.join(sorted(_FIELDS))}",
            param=unknown[0],
        )
    for name in sorted((set(body) & _INERT) - _TOLERATED):
        if body[name] not in (None, False, [], {}, ""):
            raise bad_request(f"{name}: not supported by this server")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request(f"stream: expected a boolean, got {body['stream']!r}")
    for name in ("return_logprob", "return_text_in_logprobs"):
        if name in body and not isinstance(body[name], bool):
            raise bad_request(f"{name}: expected a boolean, got {body[name]!r}")
    rid = body.get("rid")
    if rid is not None and not (
        isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))
    ):
        raise bad_request(f"rid: expected a string or a list of strings, got {rid!r}")
    text = body.get("text")
    if isinstance(text, list) and not text:
        raise bad_request("text: the list of prompts is empty")
    for name in ("text", "input_ids", "sampling_params", "rid"):
        value = body.get(name)
        if (
            isinstance(value, list)
            and len(value) > MAX_PROMPTS
            and not (name == "input_ids" and value and isinstance(value[0], int))
        ):
            raise bad_request(
                f"{name}: at most {MAX_PROMPTS} prompts per request, got {len(value)}"
            )
    ids = body.get("input_ids")
    if isinstance(ids, list) and not ids and text is None:
        raise bad_request("input_ids: the prompt is empty (no tokens)")
    params = body.get("sampling_params")
    if params is not None and not isinstance(params, (dict, list)):
        raise bad_request(f"sampling_params: expected an object, got {type(params).__name__}")


def check_constraint(params: Any, prefix: str = "") -> None:
    """Schema problems are 400s before anything is queued (regex syntax is checked by the
    engine)."""
    from plait.runtime.constrained import GrammarError, make_grammar_key

    for p in params if isinstance(params, list) else [params]:
        if not isinstance(p, dict) or all(
            p.get(k) is None for k in ("json_schema", "regex", "ebnf")
        ):
            continue
        try:
            make_grammar_key(
                json_schema=p.get("json_schema"), regex=p.get("regex"), grammar=p.get("ebnf")
            )
        except GrammarError as e:
            raise bad_request(prefix + str(e)) from None


# NOTE: a token spells at least one byte, and a tokenizer adds few of its own (BOS, a leading
# space): a text this many tokens shorter than its room fits without being tokenized here too.
_ADDED_TOKENS = 8


async def check_budgets(state: ServerState, body: dict[str, Any]) -> None:
    """A `max_new_tokens` that the context cannot hold after its prompt is a 400 naming it, as
    `max_tokens` is on the OpenAI routes (`calls.token_budget`). Malformed bodies are left to
    the engine's checks."""
    text = body.get("text")
    source = "text" if text is not None else "input_ids"
    prompts = text if text is not None else body.get("input_ids")
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    params = body.get("sampling_params")
    if not isinstance(prompts, list) or (isinstance(params, list) and len(params) != len(prompts)):
        return
    limit = min(state.engine.context_len, state.pool_tokens)
    for prompt, p in zip(prompts, params if isinstance(params, list) else [params] * len(prompts)):
        requested = p.get("max_new_tokens") if isinstance(p, dict) else None
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
            continue
        if isinstance(prompt, str):
            if len(prompt.encode()) + _ADDED_TOKENS + requested <= limit:
                continue
            prompt = await asyncio.to_thread(state.engine.tokenizer.encode, prompt)
        if isinstance(prompt, list):
            calls.token_budget(state, len(prompt), requested, source, "max_new_tokens")


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = state_of(request)
    body = await read_object(request)
    check_generate_body(body)
    check_constraint(body.get("sampling_params"))
    await check_budgets(state, body)
    kwargs = {k: v for k, v in body.items() if k in _FIELDS and k != "stream" and v is not None}
    prompts = kwargs.get("text", kwargs.get("input_ids"))
    batched = isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], int)
    count = len(prompts) if batched else 1
    kwargs["rid"] = calls.assign_rids(kwargs.get("rid"), count, batched)
    if body.get("stream"):
        chunks = await calls.stream(state, request, "generate", **kwargs)

        async def events() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                yield sse(chunk)
            yield sse("[DONE]")

        return event_stream(events())
    try:
        out = await calls.generate(state, request, "generate", **kwargs)
    except calls.ClientGone:
        return Response(status_code=499)
    # NOTE: a list keeps each result, failed ones with their abort reason (SGLang's shape), so
    # one prompt's failure never loses its siblings' finished outputs; a lone failure is an error.
    reason = {} if isinstance(out, list) else out["meta_info"]["finish_reason"] or {}
    if reason.get("status_code") is not None:  # a failure, not an abort the client asked for
        raise from_abort(reason)
    return JSONResponse(out)


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    state = state_of(request)
    body = await read_object(request)
    rid = body.get("rid")
    abort_all = body.get("abort_all")
    if abort_all is not None and not isinstance(abort_all, bool):
        raise bad_request(f"abort_all: expected a boolean, got {abort_all!r:.80}")
    if abort_all:
        for engine_rids in list(state.admission.live.values()):
            for r in engine_rids:
                state.engine.abort(r)
        return Response(status_code=200)
    if not isinstance(rid, str) or not rid:
        raise bad_request(f"rid: expected a non-empty string, got {rid!r}")
    for r in state.admission.engine_rids(rid):
        state.engine.abort(r)
    return Response(status_code=200)


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    """200 once the model is loaded (the only route open without the API key)."""
    state = state_of(request)
    return {
        "status": "ok",
        "model": state.model_name,
        "uptime_s": round(time.time() - state.started, 3),
    }


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy when the engine loop produces a token within 20 s."""
    state = state_of(request)
    ids = [state.engine.tokenizer.eos_token_id]
    try:
        await asyncio.wait_for(
            state.engine.async_generate(
                input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0}
            ),
            timeout=20,
        )
    except (asyncio.TimeoutError, RuntimeError) as e:
        raise APIError(503, f"health_generate: the engine did not answer ({e!r})") from None
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    state = state_of(request)
    engine = state.engine
    tok = engine.tokenizer
    return {
        "model_path": str(engine.model_path),
        "tokenizer_path": str(engine.model_path),
        "served_model_name": state.model_name,
        "is_generation": True,
        "context_length": engine.context_len,
        "vocab_size": tok.vocab_size,
        "chat_template": tok.chat_template,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos_token,
    }


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    state = state_of(request)
    engine = state.engine
    server = dataclasses.asdict(state.config)
    server["api_key"] = None if server["api_key"] is None else "(set)"
    stats = engine.stats()
    return {
        "version": PLAIT_VERSION,
        "model_path": str(engine.model_path),
        "context_length": engine.context_len,
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "max_total_num_tokens": stats["kv_pages_total"] * stats["page_size"],
        "engine_config": dataclasses.asdict(engine.config),
        "server_config": server,
        "programs": sorted(state.programs),
        "uptime_s": time.time() - state.started,
        "in_flight_requests": state.admission.in_flight,
        "admission_limit": state.admission.limit,
        "stats": stats,
        **stats,
    }


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    ok = await asyncio.to_thread(state_of(request).engine.flush_cache)
    if not ok:
        return PlainTextResponse(
            "Cache not flushed: requests are running or waiting. Retry when the server is idle.",
            status_code=400,
        )
    return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details.")
