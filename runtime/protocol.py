"""The shared vocabulary of plait: sampling parameters, finish reasons and request options.

Plain data only (no torch); `interpreter`, `runtime` and `server` all import it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

_MAX_NEW_TOKENS_LIMIT = 1 << 20
_GREEDY_TEMPERATURE = 1e-5
MAX_SAMPLES = 128  # the largest `n`
_NULLABLE = (
    "seed",
    "regex",
    "json_schema",
    "ebnf",
    "budget_closing",
    "closed_finish_reason",
    "json_whitespace",
)
CLOSED_FINISH_REASONS = ("length", "stop")
# How JSON under a schema is spaced:
# - conventional: one space after `:` and `,` and nowhere else (`{"a": 1, "b": [2, 3]}`), as
#   Python's `json.dumps` writes it and as models mostly saw JSON; the default.
# - compact: no whitespace (`{"a":1,"b":[2,3]}`): the fewest tokens, the most text forced.
# - flexible: whitespace of the model's choosing between JSON tokens (runs bounded by
#   `json_max_whitespace_run`), e.g. indented documents.
JSON_WHITESPACE = ("conventional", "compact", "flexible")


@dataclass
class SamplingParams:
    """Per-request sampling settings; field names follow SGLang's native protocol."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None  # JSON text (`from_dict` also takes the schema as a dict)
    ebnf: str | None = None  # a context-free grammar: GBNF / EBNF (`root ::= ...`) or Lark
    budget_closing: bool | None = None  # None: the engine's setting
    # the finish reason of an output budget-aware closing finished: "length" (None) or "stop"
    closed_finish_reason: str | None = None
    json_whitespace: str | None = None  # JSON spacing (`JSON_WHITESPACE`); None: the engine's
    token_healing: bool = False  # back the prompt up over a last token that could merge

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        """Build and validate from a JSON-like dict; unknown keys raise `ValueError` naming them."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            params.validate()
            return params
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params: expected an object, got {type(params).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"sampling_params: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known keys are {', '.join(sorted(known))}"
            )
        values = {k: v for k, v in params.items() if v is not None or k in _NULLABLE}
        sp = cls(**values)
        sp.validate()
        return sp

    def validate(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_token_ids, int):
            self.stop_token_ids = [self.stop_token_ids]
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"{name}: expected a list, got {getattr(self, name)!r}"[:200])
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_int("max_new_tokens", self.max_new_tokens, 0, _MAX_NEW_TOKENS_LIMIT)
        _check_int("min_new_tokens", self.min_new_tokens, 0, _MAX_NEW_TOKENS_LIMIT)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens: {self.min_new_tokens} is larger than max_new_tokens "
                f"{self.max_new_tokens}"
            )
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1, 1 << 31)
        if self.top_k == 0:
            raise ValueError("top_k: must be -1 (off) or at least 1, got 0")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty string, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids: expected non-negative integers, got {t!r}")
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "no_stop_trim",
            "token_healing",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a boolean, got {getattr(self, name)!r}")
        _check_int("n", self.n, 1, MAX_SAMPLES)
        if self.seed is not None:
            _check_int("seed", self.seed, -(1 << 63), (1 << 64) - 1)
        if isinstance(self.json_schema, dict):  # the schema itself, or its JSON text
            self.json_schema = json.dumps(self.json_schema)
        for name in ("regex", "json_schema", "ebnf"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: expected a string, got {type(value).__name__}")
        given = [n for n in ("regex", "json_schema", "ebnf") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(
                f"{given[1]}: give at most one of regex, json_schema, ebnf; got {', '.join(given)}"
            )
        if self.budget_closing is not None and not isinstance(self.budget_closing, bool):
            raise ValueError(f"budget_closing: expected a boolean, got {self.budget_closing!r}")
        if self.json_whitespace is not None and self.json_whitespace not in JSON_WHITESPACE:
            raise ValueError(
                f"json_whitespace: expected one of {', '.join(JSON_WHITESPACE)}, "
                f"got {self.json_whitespace!r}"[:200]
            )
        if self.closed_finish_reason not in (None, *CLOSED_FINISH_REASONS):
            raise ValueError(
                f"closed_finish_reason: expected one of {', '.join(CLOSED_FINISH_REASONS)}, "
                f"got {self.closed_finish_reason!r:.80}"
            )

    @property
    def is_greedy(self) -> bool:
        # NOTE: below 1e-5 (vLLM's threshold) logits / temperature overflows to inf.
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            raise ValueError(f"{name}: expected an integer, got float {value!r}")
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name}: must be in [{low}, {high}], got {value}")


def _check_float(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    if math.isnan(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name}: must be in {bracket}{low}, {high}], got {value}")


@dataclass(frozen=True)
class FinishReason:
    """Why a request stopped: `stop` (EOS, stop token or stop string), `length`, or `abort`.

    An abort the client did not ask for carries the HTTP status it stands for (SGLang's
    `status_code`): 400 a request the engine refused, 500 its failure, 503 the engine shutting
    down, 504 its deadline (`timeout`) passing.
    """

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
            if self.status_code is not None:
                out["status_code"] = self.status_code
        return out


@dataclass(frozen=True)
class LogprobOptions:
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False

    def validate(self) -> None:
        if not isinstance(self.return_logprob, bool):
            raise ValueError(f"return_logprob: expected a boolean, got {self.return_logprob!r}")
        _check_int("logprob_start_len", self.logprob_start_len, -1, 1 << 31)
        _check_int("top_logprobs_num", self.top_logprobs_num, 0, 1024)
