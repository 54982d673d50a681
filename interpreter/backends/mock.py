"""`MockBackend`: a scripted backend for interpreter tests (no model).

Its "tokens" are words and punctuation marks with their leading spaces. It answers in the
native protocol: stop strings and `max_new_tokens` apply, `regex` / `json_schema` outputs
comply (a scripted answer that does not is replaced by a canned one), input logprobs come
from `scorer`, and `cached_tokens` reports the longest token prefix it has seen before.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from plait.interpreter.backends.base import FEATURES, Backend
from plait.interpreter.backends.mock_values import example_for_regex, example_for_schema
from plait.interpreter.chat_template import CHATML, ChatTemplate

_TOKEN = re.compile(r"\s*(?:\w+|[^\w\s])|\s+")
Responder = Callable[[str, dict[str, Any]], str]
Scorer = Callable[[str, str], float]


def mock_tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def default_scorer(context: str, token: str) -> float:
    """Deterministic: longer tokens are less likely."""
    return -0.5 * len(token.strip() or token)


@dataclass(frozen=True)
class MockCall:
    text: str | list[str]
    sampling_params: dict[str, Any] | list[dict[str, Any]]
    return_logprob: bool
    logprob_start_len: int
    rid: str | list[str] | None
    stream: bool = False

    @property
    def is_prefill_only(self) -> bool:
        params = (
            self.sampling_params
            if isinstance(self.sampling_params, list)
            else [self.sampling_params]
        )
        return all(p.get("max_new_tokens") == 0 for p in params)


class MockBackend(Backend):
    """`responses`: one string for every call, a list used in call order, or a function
    `(prompt, sampling_params) -> str`. `latency`: seconds each generating call takes
    (abortable; prefill-only calls are instant); `stream_delay`: seconds between chunks."""

    name = "mock"

    def __init__(
        self,
        responses: str | Sequence[str] | Responder | None = None,
        *,
        scorer: Scorer = default_scorer,
        latency: float = 0.0,
        stream_delay: float = 0.0,
        features: Iterable[str] = FEATURES,
        chat_template: ChatTemplate = CHATML,
    ) -> None:
        self.responses = responses
        self.scorer = scorer
        self.latency = latency
        self.stream_delay = stream_delay
        self.features = frozenset(features)
        self.template = chat_template
        self.calls: list[MockCall] = []
        self.aborted: list[str] = []
        self.max_concurrency = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._next = 0
        self._active = 0
        self._aborts: dict[str, threading.Event] = {}
        self._seen: list[list[str]] = []

    def chat_template(self) -> ChatTemplate:
        return self.template

    def count_prompt_tokens(self, text: str, rid: str | None = None) -> int:
        return len(mock_tokenize(text))

    def abort(self, rid: str) -> None:
        with self._lock:
            self.aborted.append(rid)
            event = self._aborts.get(rid)
        if event is not None:
            event.set()

    def wait_for_active(self, n: int, timeout: float = 30.0) -> bool:
        """Blocks until at least `n` calls are in flight at once (False after `timeout`, a hang
        guard): a test's way to know its calls are running, without sleeping."""
        with self._changed:
            return self._changed.wait_for(lambda: self._active >= n, timeout)

    def wait_for_idle(self, timeout: float = 30.0) -> bool:
        """Blocks until no call is in flight (False after `timeout`, a hang guard)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._active == 0, timeout)

    @property
    def generate_calls(self) -> list[MockCall]:
        """Calls that generated text (not prefill-only warm-ups or scoring)."""
        return [c for c in self.calls if not c.is_prefill_only]

    def generate(
        self,
        text: str | list[str],
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        *,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        call = MockCall(text, sampling_params, return_logprob, logprob_start_len, rid)
        self._record(call)
        texts = text if isinstance(text, list) else [text]
        params = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(texts)
        )
        rids = rid if isinstance(rid, list) else [rid or uuid.uuid4().hex] * len(texts)
        try:
            aborted = self._wait(rids, 0.0 if call.is_prefill_only else self.latency)
            outs = [
                self._respond(
                    t, p, r, aborted, return_logprob, logprob_start_len, return_text_in_logprobs
                )
                for t, p, r in zip(texts, params, rids)
            ]
        finally:
            self._finish(rids)
        return outs if isinstance(text, list) else outs[0]

    def generate_stream(
        self, text: str, sampling_params: dict[str, Any], *, rid: str | None = None
    ) -> Iterator[dict[str, Any]]:
        rid = rid or uuid.uuid4().hex
        self._record(MockCall(text, sampling_params, False, -1, rid, stream=True))
        try:
            aborted = self._wait([rid], self.latency)
            final = self._respond(text, sampling_params, rid, aborted, False, -1, False)
            pieces = mock_tokenize(final["text"])
            for i in range(1, len(pieces)):
                meta = {**final["meta_info"], "finish_reason": None, "completion_tokens": i}
                yield {"text": "".join(pieces[:i]), "output_ids": [], "meta_info": meta}
                time.sleep(self.stream_delay)
            yield final
        finally:
            self._finish([rid])

    # internals ------------------------------------------------------------------------------

    def _record(self, call: MockCall) -> None:
        with self._lock:
            self.calls.append(call)
            self._active += 1
            self.max_concurrency = max(self.max_concurrency, self._active)
            self._changed.notify_all()

    def _wait(self, rids: list[str], latency: float) -> set[str]:
        events = {r: threading.Event() for r in rids}
        with self._lock:
            self._aborts.update(events)
            for r, event in events.items():
                if r in self.aborted:  # aborted before the call got here
                    event.set()
        deadline = time.monotonic() + latency
        while latency and time.monotonic() < deadline:
            if any(e.is_set() for e in events.values()):
                break
            time.sleep(min(0.005, latency))
        return {r for r, e in events.items() if e.is_set()}

    def _finish(self, rids: list[str]) -> None:
        with self._lock:
            self._active -= 1
            self._changed.notify_all()
            for r in rids:
                self._aborts.pop(r, None)

    def _script(self, prompt: str, params: dict[str, Any]) -> str:
        if callable(self.responses):
            return self.responses(prompt, params)
        if isinstance(self.responses, str):
            return self.responses
        if self.responses is None:
            return "mock output"
        with self._lock:
            if self._next >= len(self.responses):
                raise RuntimeError(
                    f"MockBackend: all {len(self.responses)} scripted responses are used"
                )
            self._next += 1
            return self.responses[self._next - 1]

    def _respond(
        self,
        prompt: str,
        params: dict[str, Any],
        rid: str,
        aborted: set[str],
        return_logprob: bool,
        start: int,
        with_text: bool,
    ) -> dict[str, Any]:
        prompt_tokens = mock_tokenize(prompt)
        max_new = params.get("max_new_tokens", 128)
        reason: dict[str, Any]
        if rid in aborted:
            text, reason = "", {"type": "abort", "message": "aborted by the client"}
        elif max_new == 0:
            text, reason = "", {"type": "length", "length": 0}
        else:
            text, reason = self._complete(prompt, params, max_new)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(prompt_tokens),
            "completion_tokens": len(mock_tokenize(text)),
            "cached_tokens": self._cached(prompt_tokens),
            "e2e_latency": self.latency,
        }
        if return_logprob:
            first = len(prompt_tokens) - 1 if start < 0 else min(start, len(prompt_tokens) - 1)
            meta["input_token_logprobs"] = [
                [
                    None if i == first else self.scorer("".join(prompt_tokens[:i]), tok),
                    _id(tok),
                    tok if with_text else None,
                ]
                for i, tok in enumerate(prompt_tokens)
                if i >= first
            ]
            meta["output_token_logprobs"] = []
        return {
            "text": text,
            "output_ids": [_id(t) for t in mock_tokenize(text)],
            "meta_info": meta,
        }

    def _complete(
        self, prompt: str, params: dict[str, Any], max_new: int
    ) -> tuple[str, dict[str, Any]]:
        text = self._script(prompt, params)
        if params.get("regex") and re.fullmatch(params["regex"], text) is None:
            text = example_for_regex(params["regex"])
        if params.get("json_schema"):
            try:
                json.loads(text)
            except json.JSONDecodeError:
                text = json.dumps(example_for_schema(json.loads(params["json_schema"])))
        hits = [(text.find(s), s) for s in params.get("stop") or [] if s in text]
        if hits:
            index, matched = min(hits)
            return text[:index], {"type": "stop", "matched": matched}
        pieces = mock_tokenize(text)
        if len(pieces) > max_new:
            return "".join(pieces[:max_new]), {"type": "length", "length": max_new}
        return text, {"type": "stop", "matched": None}

    def _cached(self, tokens: list[str]) -> int:
        with self._lock:
            best = 0
            for seen in self._seen:
                n = 0
                for a, b in zip(seen, tokens):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            self._seen = [*self._seen[-511:], tokens]
            return best


def _id(token: str) -> int:
    return zlib.crc32(token.encode()) % 49152
