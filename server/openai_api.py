"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from plait.server import calls
from plait.server import openai_format as fmt
from plait.server.errors import APIError, bad_request, model_not_found, parse_model, read_object
from plait.server.native import MAX_PROMPTS, check_constraint, event_stream, sse, state_of
from plait.server.openai_protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from plait.server.state import ServerState
from plait.server.tool_calls import ToolPlan, plan_tools, render_messages

router = APIRouter(prefix="/v1")

_PASSTHROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "token_healing",
    "closed_finish_reason",
    "json_whitespace",
)


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state_of(request))]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    if model_id != state.model_name:
        raise model_not_found(model_id, state.model_name)
    return _model_card(state)


def served_model(state: ServerState, model: str | None) -> str:
    """The `model` a response names: the request's, which must be the served one unless the
    server takes any (`accept_any_model`); the served one when the request names none."""
    if model is None:
        return state.model_name
    if model != state.model_name and not state.config.accept_any_model:
        raise model_not_found(model, state.model_name)
    return model


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "plait",
        "max_model_len": state.engine.context_len,
    }


def sampling_params(req: _Sampling, max_new_tokens: int, json_schema: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": req.n}
    for name in _PASSTHROUGH:
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    if req.min_tokens is not None:
        params["min_new_tokens"] = min(req.min_tokens, max_new_tokens)
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if req.budget_closing is not None:
        params["budget_closing"] = req.budget_closing
    given = request_constraints(req)
    if json_schema is not None:
        given.insert(0, ("response_format", "json_schema", json_schema))
    if len(given) > 1:
        names = [name for name, _, _ in given]
        raise bad_request(
            f"{names[1]}: give at most one constraint; got {', '.join(names)}", names[1]
        )
    if given:
        _, field, value = given[0]
        if field == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)
        params[field] = value
    return params


def renames(req: _Sampling) -> dict[str, str]:
    """Engine fields as this request spells them, for the 400s the engine raises."""
    out = {"max_new_tokens": "max_tokens"}
    if getattr(req, "response_format", None) is not None:
        out["json_schema"] = "response_format: json_schema"
    given = request_constraints(req)
    for name, field, _ in given[:1]:
        out[field] = name
    return out


def request_constraints(req: _Sampling) -> list[tuple[str, str, Any]]:
    """(request field, sampling field, value) of each constraint a request gives: `regex`,
    `ebnf`, vLLM's `guided_*` fields and `structured_outputs`."""
    from plait.runtime.constrained.patterns import choices_regex

    so = req.structured_outputs
    fields = [
        ("regex", "regex", req.regex),
        ("ebnf", "ebnf", req.ebnf),
        ("guided_json", "json_schema", req.guided_json),
        ("guided_regex", "regex", req.guided_regex),
        ("guided_grammar", "ebnf", req.guided_grammar),
        ("guided_choice", "regex", req.guided_choice),
        ("structured_outputs.json", "json_schema", so and so.json_),
        ("structured_outputs.regex", "regex", so and so.regex),
        ("structured_outputs.grammar", "ebnf", so and so.grammar),
        ("structured_outputs.choice", "regex", so and so.choice),
        (
            "structured_outputs.json_object",
            "json_schema",
            so and so.json_object and {"type": "object"},
        ),
    ]
    given = []
    for name, field, value in fields:
        if value is None or value is False:
            continue
        if name.endswith("choice"):
            try:
                value = choices_regex(value)
            except ValueError as e:
                raise bad_request(f"{name}: {e}", name) from None
        given.append((name, field, value))
    return given


def response_schema(req: ChatCompletionRequest | CompletionRequest) -> Any:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return getattr(req, "json_schema", None)
    if rf.type == "json_object":
        return {"type": "object"}
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("response_format.json_schema.schema: required for type json_schema")
    return rf.json_schema.schema_


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    bos = tokenizer.bos_token
    with_bos = not (bos and tokenizer.add_bos_token and text.startswith(bos))
    return tokenizer.encode(text, add_special_tokens=with_bos)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    req = parse_model(ChatCompletionRequest, await read_object(request))
    model = served_model(state, req.model)
    tok = state.engine.tokenizer
    renders_tools = "tools" in (tok.chat_template or "")
    plan = plan_tools(req.tools, req.tool_choice, renders_tools)
    schema = response_schema(req)
    if plan.forced:
        if schema is not None:
            raise bad_request(
                "response_format: cannot be combined with a required or named tool_choice"
            )
        schema = plan.schema
    messages = render_messages(req.messages, plan, renders_tools)
    extra = req.chat_template_kwargs or {}
    tools = (
        [t.model_dump(exclude_none=True) for t in plan.tools]
        if renders_tools and plan.tools
        else None
    )
    try:
        prompt = tok.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tools=tools,
            continue_final_message=req.continue_final_message,
            **extra,
        )
    except (ValueError, TypeError) as e:  # TypeError: chat_template_kwargs naming a parameter
        raise bad_request(f"messages: {e}", "messages") from None
    ids = encode_prompt(tok, prompt + plan.prompt_suffix)
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    params = sampling_params(
        req, calls.token_budget(state, len(ids), requested, "messages"), schema
    )
    check_constraint(params, "response_format: " if req.response_format else "")
    rid = req.rid or f"chatcmpl-{uuid.uuid4().hex}"
    kwargs = {
        "input_ids": ids,
        "sampling_params": params,
        "rid": rid,
        "return_logprob": req.logprobs,
        "top_logprobs_num": req.top_logprobs or 0,
        "return_text_in_logprobs": True,
        "timeout": req.timeout,
        "client_id": calls.client_of(request, req.user),
        "rename": renames(req),
    }
    if req.stream:
        chunks = await calls.stream(state, request, "chat", **kwargs)
        return event_stream(_chat_events(state, req, plan, chunks, rid, model, len(ids)))
    outs = await _generate_all(state, request, "chat", kwargs)
    if isinstance(outs, Response):
        return outs
    choices = []
    for i, o in enumerate(outs):
        message, reason = fmt.chat_message(o, plan)
        logprobs = fmt.chat_logprobs(o["meta_info"], 0, tok) if req.logprobs else None
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
                **fmt.closed_early(o["meta_info"]),
            }
        )
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": fmt.now(),
            "model": model,
            "choices": choices,
            "usage": fmt.usage(len(ids), outs),
        }
    )


async def _chat_events(
    state: ServerState,
    req: ChatCompletionRequest,
    plan: ToolPlan,
    chunks: AsyncIterator[dict],
    rid: str,
    model: str,
    prompt_tokens: int,
) -> AsyncIterator[bytes]:
    tok = state.engine.tokenizer
    base = fmt.chunk_base("chat.completion.chunk", rid, model, fmt.now())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if include_usage:
        base["usage"] = None
    choices = [fmt.ChoiceStream(i, plan) for i in range(req.n)]
    finals: dict[int, dict] = {}
    async for out in chunks:
        index = out.get("index", 0)
        if _aborted(out):
            yield sse(_stream_error(out))
            return
        chunk = fmt.chat_chunk(base, choices[index], out, tok, req.logprobs)
        if chunk is not None:
            yield sse(chunk)
        if choices[index].done:
            finals[index] = out
    if include_usage:
        outs = [finals[i] for i in sorted(finals)]
        yield sse({**base, "choices": [], "usage": fmt.usage(prompt_tokens, outs)})
    yield sse("[DONE]")


def _aborted(out: dict) -> bool:
    reason = out["meta_info"].get("finish_reason") or {}
    return reason.get("type") == "abort"


def _stream_error(out: dict) -> dict[str, Any]:
    try:
        fmt.check_not_aborted([out])
    except APIError as e:
        return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}}
    return {}


@router.post("/completions")
async def completions(request: Request) -> Response:
    state = state_of(request)
    req = parse_model(CompletionRequest, await read_object(request))
    model = served_model(state, req.model)
    tok = state.engine.tokenizer
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of: only best_of == n is supported", "best_of")
    prompts = _prompts(req.prompt, tok)
    budgets = [calls.token_budget(state, len(p), req.max_tokens, "prompt") for p in prompts]
    params = [sampling_params(req, b, response_schema(req)) for b in budgets]
    check_constraint(params[0], "")
    batched = len(prompts) > 1
    rid = req.rid or f"cmpl-{uuid.uuid4().hex}"
    kwargs = {
        "rename": renames(req),
        "input_ids": prompts if batched else prompts[0],
        "sampling_params": params if batched else params[0],
        "rid": calls.assign_rids(rid, len(prompts), batched),
        "return_logprob": req.logprobs is not None,
        "top_logprobs_num": req.logprobs or 0,
        "return_text_in_logprobs": True,
        "logprob_start_len": 0 if req.echo else -1,
        "timeout": req.timeout,
        "client_id": calls.client_of(request, req.user),
    }
    texts = [tok.decode(p, skip_special_tokens=False) for p in prompts] if req.echo else None
    prompt_tokens = sum(len(p) for p in prompts)
    if req.stream:
        chunks = await calls.stream(state, request, "completions", **kwargs)
        return event_stream(
            _completion_events(state, req, chunks, rid, model, texts, prompt_tokens, len(prompts))
        )
    outs = await _generate_all(state, request, "completions", kwargs)
    if isinstance(outs, Response):
        return outs
    choices = []
    for i, o in enumerate(outs):
        prefix = texts[i // req.n] if texts else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = fmt.completion_logprobs(o["meta_info"], 0, 0, tok, req.echo)
        choices.append(
            {
                "index": i,
                "text": prefix + o["text"],
                "logprobs": logprobs,
                "finish_reason": fmt.finish_reason(o["meta_info"]),
                **fmt.closed_early(o["meta_info"]),
            }
        )
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": fmt.now(),
            "model": model,
            "choices": choices,
            "usage": fmt.usage(prompt_tokens, outs, len(prompts)),
        }
    )


def _prompts(prompt: Any, tok: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt: must not be empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
    out = [encode_prompt(tok, p) if isinstance(p, str) else list(p) for p in prompt]
    for i, ids in enumerate(out):
        if not ids:
            raise bad_request(f"prompt: prompt {i} is empty (no tokens)", "prompt")
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise bad_request(f"prompt: token id {bad[0]} is outside the vocabulary", "prompt")
    return out


async def _completion_events(
    state: ServerState,
    req: CompletionRequest,
    chunks: AsyncIterator[dict],
    rid: str,
    model: str,
    texts: list[str] | None,
    prompt_tokens: int,
    num_prompts: int,
) -> AsyncIterator[bytes]:
    tok = state.engine.tokenizer
    base = fmt.chunk_base("text_completion", rid, model, fmt.now())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if include_usage:
        base["usage"] = None
    sent: dict[int, tuple[int, int, int]] = {}  # index -> (text chars, logprob entries, offset)
    finals: dict[int, dict] = {}
    async for out in chunks:
        index = out.get("index", 0)
        if _aborted(out):
            yield sse(_stream_error(out))
            return
        chars, entries, offset = sent.get(index, (0, 0, 0))
        text = out["text"][chars:]
        if texts and index not in sent:
            text = texts[index // req.n] + text
        logprobs = None
        if req.logprobs is not None:
            logprobs = fmt.completion_logprobs(out["meta_info"], entries, offset, tok, req.echo)
            entries += len(logprobs["tokens"]) if logprobs else 0
            offset += len(text)
        reason = fmt.finish_reason(out["meta_info"])
        sent[index] = (len(out["text"]), entries, offset)
        if reason is not None:
            finals[index] = out
        if text or reason is not None:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": reason,
                **fmt.closed_early(out["meta_info"]),
            }
            yield sse({**base, "choices": [choice]})
    if include_usage:
        outs = [finals[i] for i in sorted(finals)]
        yield sse({**base, "choices": [], "usage": fmt.usage(prompt_tokens, outs, num_prompts)})
    yield sse("[DONE]")


async def _generate_all(state: Any, request: Any, kind: str, kwargs: dict) -> list[dict] | Response:
    """The engine's results as a list (aborts raised as errors), or a 499 if the client left."""
    try:
        out = await calls.generate(state, request, kind, **kwargs)
    except calls.ClientGone:
        return Response(status_code=499)
    outs = out if isinstance(out, list) else [out]
    fmt.check_not_aborted(outs)
    return outs
