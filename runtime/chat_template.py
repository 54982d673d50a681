"""Rendering chat templates (Jinja) the way transformers does, sandboxed."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **context: Any,
) -> str:
    """`continue_final_message` leaves the last message open and adds no generation prompt."""
    try:
        text = _compile_chat_template(template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            **context,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template: {e}") from e
    if continue_final_message:
        text = _cut_after_final_message(text, messages)
    return text


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: unlike jinja's own, it does not HTML-escape `<`, `>`, `&`, `'`."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    if not messages:
        raise ValueError("continue_final_message: messages is empty")
    content = messages[-1].get("content")
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict)]
        content = texts[-1] if texts else ""
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the final message has no text content")
    where = text.rfind(content.strip())
    if where < 0:
        raise ValueError(
            "continue_final_message: the template does not render the final message verbatim"
        )
    kept = (
        content.lstrip()
        if text[where : where + len(content.lstrip())] == content.lstrip()
        else content.strip()
    )
    return text[: where + len(kept)]
