"""Native engine results -> OpenAI response objects: choices, logprobs, usage, stream chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from plait.server.errors import from_abort
from plait.server.tool_calls import ToolPlan, ToolStreamFilter, parse_tool_calls

_FINISH = {"stop": "stop", "length": "length"}


def check_not_aborted(outs: list[dict]) -> None:
    """An engine-side abort as its HTTP error (`errors.from_abort`)."""
    for out in outs:
        reason = out["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise from_abort(reason)


def finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else _FINISH.get(reason["type"], reason["type"])


def usage(prompt_tokens: int, outs: list[dict], num_prompts: int = 1) -> dict[str, Any]:
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    n = max(1, len(outs) // max(1, num_prompts))
    # NOTE: the n samples of a prompt share it: count its tokens (and cache hits) once.
    cached = sum(o["meta_info"].get("cached_tokens", 0) for o in outs[::n])
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": min(cached, prompt_tokens)},
    }


def _token_entry(entry: list[Any], tokenizer: Any) -> dict[str, Any]:
    logprob, token_id, text = entry
    raw = tokenizer.token_bytes(token_id)
    return {
        "token": text if text is not None else raw.decode("utf-8", "replace"),
        "logprob": logprob,
        "bytes": list(raw),
    }


def chat_logprobs(meta: dict[str, Any], start: int, tokenizer: Any) -> dict[str, Any] | None:
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return None
    tops = meta.get("output_top_logprobs") or []
    content = []
    for i in range(start, len(entries)):
        item = _token_entry(entries[i], tokenizer)
        top = tops[i] if i < len(tops) and tops[i] else []
        item["top_logprobs"] = [_token_entry(t, tokenizer) for t in top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(
    meta: dict[str, Any], start: int, offset: int, tokenizer: Any, echo: bool
) -> dict[str, Any] | None:
    """The legacy format; with `echo`, prompt tokens come first (the first has logprob None)."""
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return None
    tops = meta.get("output_top_logprobs") or []
    if echo:
        prompt = meta.get("input_token_logprobs") or []
        entries = prompt + entries
        tops = (meta.get("input_top_logprobs") or [None] * len(prompt)) + tops
    tokens, logprobs, top_logprobs, offsets = [], [], [], []
    for i in range(start, len(entries)):
        item = _token_entry(entries[i], tokenizer)
        tokens.append(item["token"])
        logprobs.append(item["logprob"])
        top = tops[i] if i < len(tops) else None
        top_logprobs.append(
            {_token_entry(t, tokenizer)["token"]: t[0] for t in top} if top else None
        )
        offsets.append(offset)
        offset += len(item["token"])
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_message(out: dict, plan: ToolPlan) -> tuple[dict[str, Any], str | None]:
    text = out["text"]
    reason = finish_reason(out["meta_info"])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if plan.mode != "none":
        content, calls = parse_tool_calls(text, plan)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            reason = "tool_calls"
    return message, reason


@dataclass
class ChoiceStream:
    """What one streamed choice has sent so far."""

    index: int
    plan: ToolPlan
    text_sent: int = 0
    logprobs_sent: int = 0
    started: bool = False
    done: bool = False
    tools: ToolStreamFilter | None = None
    last: dict[str, Any] = field(default_factory=dict)


def chunk_base(kind: str, rid: str, model: str, created: int) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": created, "model": model}


def chat_chunk(
    base: dict[str, Any], choice: ChoiceStream, out: dict, tokenizer: Any, want_logprobs: bool
) -> dict[str, Any] | None:
    """The next chunk for `choice` given its cumulative output, or None when nothing is new."""
    meta = out["meta_info"]
    reason = finish_reason(meta)
    text = out["text"]
    delta: dict[str, Any] = {}
    if not choice.started:
        delta["role"] = "assistant"
        choice.started = True
    if choice.plan.mode == "auto":
        choice.tools = choice.tools or ToolStreamFilter()
        new_text = choice.tools.feed(text)
    elif choice.plan.forced:
        new_text = ""  # the call is sent whole when it is complete
    else:
        new_text = text[choice.text_sent :]
    choice.text_sent = len(text)
    if reason is not None:
        if choice.plan.mode == "auto" and choice.tools is not None:
            rest, calls = choice.tools.finish(choice.plan)
        else:
            rest, calls = "", []
            if choice.plan.forced:
                content, calls = parse_tool_calls(text, choice.plan)
                rest = "" if calls else (content or "")
        new_text += rest
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            reason = "tool_calls"
        choice.done = True
    if new_text:
        delta["content"] = new_text
    logprobs = None
    if want_logprobs:
        logprobs = chat_logprobs(meta, choice.logprobs_sent, tokenizer)
        choice.logprobs_sent = len(meta.get("output_token_logprobs") or [])
    if not delta and reason is None and not (logprobs and logprobs["content"]):
        return None
    entry = {
        "index": choice.index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": reason,
        **closed_early(meta),
    }
    return {**base, "choices": [entry]}


def closed_early(meta: dict[str, Any]) -> dict[str, Any]:
    """`{"closed_early": true}` for a choice that budget-aware closing finished (its
    finish_reason "length", or "stop" where the request asked), else nothing: OpenAI's own
    fields are unchanged."""
    return {"closed_early": True} if meta.get("closed_early") and meta.get("finish_reason") else {}


def now() -> int:
    return int(time.time())
