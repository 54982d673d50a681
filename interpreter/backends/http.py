"""`Endpoint`: programs against a server that speaks the native protocol (a plait server, or
any SGLang-compatible one): `POST /generate`, `GET /get_model_info`, `POST /flush_cache`.

Uses only the standard library (urllib), one connection per call.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from plait.interpreter.backends.base import Backend
from plait.interpreter.chat_template import (
    CHATML,
    ChatTemplate,
    jinja_chat_template,
    resolve_chat_template,
)
from plait.interpreter.errors import BackendError


class Endpoint(Backend):
    """Chat template: `chat_template=` if given; else the Jinja source the server reports in
    `/get_model_info` as `chat_template` (a plait server does; bos/eos tokens from the same
    answer); else ChatML, which is what SmolLM2, Qwen and many others use."""

    name = "endpoint"

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        chat_template: ChatTemplate | str | None = None,
        timeout: float = 600.0,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Endpoint: url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.model_info: dict[str, Any] = self._request("GET", "/get_model_info")
        self._template = resolve_chat_template(chat_template, self._server_template())

    def _server_template(self) -> ChatTemplate:
        source = self.model_info.get("chat_template")
        if not isinstance(source, str) or not source:
            return CHATML
        context = {
            k: self.model_info[k] for k in ("bos_token", "eos_token") if self.model_info.get(k)
        }
        return jinja_chat_template(
            source, name=str(self.model_info.get("model_path", self.url)), **context
        )

    def chat_template(self) -> ChatTemplate:
        return self._template

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
        payload: dict[str, Any] = {"text": text, "sampling_params": sampling_params}
        if return_logprob:
            payload.update(
                return_logprob=True,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                return_text_in_logprobs=return_text_in_logprobs,
            )
        if rid is not None:
            payload["rid"] = rid
        return self._request("POST", "/generate", payload)

    def generate_stream(
        self, text: str, sampling_params: dict[str, Any], *, rid: str | None = None
    ) -> Iterator[dict[str, Any]]:
        payload: dict[str, Any] = {"text": text, "sampling_params": sampling_params, "stream": True}
        if rid is not None:
            payload["rid"] = rid
        with self._open("POST", "/generate", payload) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)

    def abort(self, rid: str) -> None:
        try:
            self._request("POST", "/abort_request", {"rid": rid})
        except BackendError:  # best effort: older servers lack the route
            pass

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def get_server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")

    # HTTP -------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, payload: Any = None) -> Any:
        with self._open(method, path, payload) as response:
            body = response.read().decode("utf-8")
        try:
            return json.loads(body) if body else None
        except json.JSONDecodeError:
            return body  # e.g. /flush_cache answers plain text

    def _open(self, method: str, path: str, payload: Any = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:1000]
            raise BackendError(f"{method} {self.url}{path}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise BackendError(
                f"{method} {self.url}{path}: cannot reach the server ({reason})"
            ) from None
