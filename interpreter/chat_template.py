"""Role markers: the text a chat template puts before and after each message's content.

`s += user("hi")` appends `prefix + "hi" + suffix`; a `gen` inside `assistant(...)` therefore
continues right after the assistant prefix, as the model was trained to.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_CONTENT = "PLAITCONTENTSENTINEL"
_HISTORY = "PLAITHISTORY"


@dataclass(frozen=True)
class RoleMarkers:
    prefix: str
    suffix: str


class ChatTemplate(ABC):
    """Maps a role, given the roles of the messages before it, to its markers.

    Invariant: for any conversation, concatenating `prefix + content + suffix` of every message
    equals the template's own rendering of that conversation (without a generation prompt).
    """

    name: str = "template"

    @abstractmethod
    def markers(self, role: str, history: tuple[str, ...]) -> RoleMarkers: ...


class ChatMLTemplate(ChatTemplate):
    """`<|im_start|>role\\n ... <|im_end|>\\n`: the default where a backend knows no template."""

    name = "chatml"

    def markers(self, role: str, history: tuple[str, ...]) -> RoleMarkers:
        return RoleMarkers(f"<|im_start|>{role}\n", "<|im_end|>\n")


class RenderedChatTemplate(ChatTemplate):
    """Markers read off a renderer (a model's Jinja template) by rendering sentinel messages.

    `strip_leading` (e.g. the BOS token, when the tokenizer adds it itself) is cut from the
    start of the first message's prefix so it is not sent twice.
    """

    def __init__(
        self,
        render: Callable[[list[dict[str, Any]]], str],
        name: str = "model",
        strip_leading: str | None = None,
    ) -> None:
        self.render = render
        self.name = name
        self.strip_leading = strip_leading
        self._cache: dict[tuple[str, tuple[str, ...]], RoleMarkers] = {}
        self._lock = threading.Lock()

    def markers(self, role: str, history: tuple[str, ...]) -> RoleMarkers:
        key = (role, history)
        with self._lock:
            found = self._cache.get(key)
        if found is None:
            found = self._derive(role, history)
            with self._lock:
                self._cache[key] = found
        return found

    def _derive(self, role: str, history: tuple[str, ...]) -> RoleMarkers:
        before = [{"role": r, "content": _HISTORY} for r in history]
        try:
            prev = self.render(before) if before else ""
            full = self.render([*before, {"role": role, "content": _CONTENT}])
        except Exception as e:
            raise ValueError(
                f"chat template {self.name}: cannot render a {role!r} message after "
                f"{list(history) or 'no messages'}: {e}"
            ) from None
        if not full.startswith(prev) or full.count(_CONTENT) != 1:
            raise ValueError(
                f"chat template {self.name}: a {role!r} message does not render as an addition "
                "to the conversation before it; pass chat_template='chatml' or a ChatTemplate"
            )
        prefix, suffix = full[len(prev) :].split(_CONTENT)
        if not history and self.strip_leading and prefix.startswith(self.strip_leading):
            prefix = prefix[len(self.strip_leading) :]
        return RoleMarkers(prefix, suffix)


CHATML = ChatMLTemplate()


def jinja_chat_template(source: str, name: str = "jinja", **context: Any) -> RenderedChatTemplate:
    """A template from Jinja source (as in tokenizer_config.json); `context` e.g. bos_token."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(source)

    def render(messages: list[dict[str, Any]]) -> str:
        return compiled.render(messages=messages, add_generation_prompt=False, **context)

    return RenderedChatTemplate(render, name)


def resolve_chat_template(value: ChatTemplate | str | None, default: ChatTemplate) -> ChatTemplate:
    """`None` -> `default`; "chatml"; Jinja source; or a `ChatTemplate` as is."""
    if value is None:
        return default
    if isinstance(value, ChatTemplate):
        return value
    if isinstance(value, str):
        return CHATML if value == "chatml" else jinja_chat_template(value)
    raise TypeError(
        f"chat_template: expected a ChatTemplate, 'chatml' or Jinja source, got {value!r}"
    )
