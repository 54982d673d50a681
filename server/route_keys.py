"""The text a request's prompt starts with, as the router's prefix trees key it.

Keys are characters, not token ids: the router loads no tokenizer and chat requests arrive as
messages that only the replica renders through its template. Any rendering that keeps the
order of the prompt works, because two requests that share a rendered prefix share a key
prefix too. Token-id prompts become their ids joined by commas.
"""

from __future__ import annotations

import json
from typing import Any


def generate_key(body: dict[str, Any]) -> str:
    """`/generate`: `text`, else `input_ids` (the first prompt of a batch)."""
    text = body.get("text")
    if isinstance(text, list):
        text = text[0] if text else None
    if isinstance(text, str):
        return text
    return _ids_key(body.get("input_ids"))


def completion_key(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return _ids_key(prompt)


def chat_key(body: dict[str, Any]) -> str:
    """Tools first (templates render them into the system turn), then each message in order."""
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append(json.dumps(tools, sort_keys=True, default=str))
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        parts.append(f"<{m.get('role')}>{_content_text(m.get('content'))}")
    return "\n".join(parts)


def program_key(name: str, body: dict[str, Any]) -> str:
    arguments = body.get("arguments") or {}
    return f"program:{name}\n" + json.dumps(arguments, sort_keys=True, default=str)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text")
        return "".join(t for t in texts if isinstance(t, str))  # the replica says what is wrong
    return ""


def _ids_key(ids: Any) -> str:
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return ",".join(map(str, ids)) + ","
    return ""
