"""Sampling settings as a program states them: plain data, unset fields left to the backend."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

# plait / SGLang frontend name -> native protocol name
_NATIVE_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


@dataclass(frozen=True)
class SamplingSpec:
    """Every field is optional: None means "not set here" (a run default or the backend's)."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    token_healing: bool | None = None  # None: on where the backend has it
    json_whitespace: str | None = None  # JSON spacing: "conventional", "compact" or "flexible"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, int):
            object.__setattr__(self, "stop_token_ids", (self.stop_token_ids,))
        elif self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("max_tokens", "min_tokens"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
        if self.temperature is not None and (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or self.temperature < 0
        ):
            raise ValueError(
                f"temperature: expected a non-negative number, got {self.temperature!r}"
            )
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: expected non-empty strings, got {list(self.stop)!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> SamplingSpec:
        """From keyword arguments; `max_new_tokens` / `min_new_tokens` are accepted as aliases."""
        values = dict(kwargs)
        for ours, native in _NATIVE_NAMES.items():
            if native in values:
                if values.get(ours) is not None:
                    raise ValueError(f"{ours}: given twice (also as {native})")
                values[ours] = values.pop(native)
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise TypeError(f"unknown sampling argument(s): {', '.join(unknown)}")
        return cls(**values)

    def over(self, defaults: SamplingSpec) -> SamplingSpec:
        """This spec with its unset fields taken from `defaults`."""
        mine = {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }
        return replace(defaults, **mine)

    def to_native(self) -> dict[str, Any]:
        """The set fields under their native-protocol names (`max_tokens` -> `max_new_tokens`)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[_NATIVE_NAMES.get(f.name, f.name)] = (
                    list(value) if isinstance(value, tuple) else value
                )
        return out
