"""What a program state holds: text, variables, messages, the open role, tool calls.

Plain single-threaded data; `StreamExecutor.write()` is the only way to change it while a
program runs (it holds the state's lock and wakes readers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plait.interpreter.chat_template import ChatTemplate


@dataclass
class ToolCall:
    """One tool call a `gen(tools=...)` made: what the model asked and what came back."""

    name: str
    arguments: Any
    result: Any = None
    error: str | None = None
    variable: str | None = None


@dataclass
class StateData:
    text: str = ""
    variables: dict[str, Any] = field(default_factory=dict)
    var_texts: dict[str, str] = field(default_factory=dict)
    meta_infos: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    role: str | None = None  # the open message's role
    role_start: int = 0  # where the open message's content begins in `text`
    tool_calls: list[ToolCall] = field(default_factory=list)
    written: set[str] = field(default_factory=set)  # variables set here, not inherited by a fork

    def copy(self) -> StateData:
        return StateData(
            self.text,
            dict(self.variables),
            dict(self.var_texts),
            dict(self.meta_infos),
            [dict(m) for m in self.messages],
            self.role,
            self.role_start,
            list(self.tool_calls),
        )

    def append(self, text: str, var: str | None = None) -> None:
        self.text += text
        if var is not None:
            self.var_texts[var] = self.var_texts.get(var, "") + text

    def replace_from(self, start: int, text: str, var: str | None = None) -> None:
        """Make the text after `start` equal `text` (a streamed gen's cumulative output)."""
        self.text = self.text[:start] + text
        if var is not None:
            self.var_texts[var] = text

    def set_var(
        self, name: str, value: Any, meta_info: Any = None, text: str | None = None
    ) -> None:
        self.variables[name] = value
        if text is not None:
            self.var_texts[name] = text
        if meta_info is not None:
            self.meta_infos[name] = meta_info
        self.written.add(name)

    def begin_role(self, role: str, template: ChatTemplate) -> None:
        if self.role is not None:
            raise ValueError(
                f"{role}: messages cannot nest; the {self.role!r} message is still open"
            )
        markers = template.markers(role, tuple(m["role"] for m in self.messages))
        self.text += markers.prefix
        self.role, self.role_start = role, len(self.text)

    def end_role(self, role: str, template: ChatTemplate) -> None:
        if self.role != role:
            open_ = f"the open message is {self.role!r}" if self.role else "no message is open"
            raise ValueError(f"{role}: cannot end a {role!r} message, {open_}")
        history = tuple(m["role"] for m in self.messages)
        self.messages.append({"role": role, "content": self.text[self.role_start :]})
        self.text += template.markers(role, history).suffix
        self.role = None
