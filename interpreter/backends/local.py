"""`Runtime`: programs on an in-process `Engine` (the model runs in this process)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from plait.interpreter.backends.base import FEATURES, Backend
from plait.interpreter.chat_template import (
    CHATML,
    ChatTemplate,
    RenderedChatTemplate,
    resolve_chat_template,
)


class Runtime(Backend):
    """`Runtime(model_path=None, **engine_args)` starts an `Engine` (the embedded default
    model when no path is given) and owns it; `Runtime(engine=...)` wraps an existing one.
    Roles render through the model's own chat template (ChatML if it has none)."""

    name = "runtime"
    features = FEATURES | {"token_healing"}

    def __init__(
        self,
        model_path: str | None = None,
        *,
        engine: Any = None,
        chat_template: ChatTemplate | str | None = None,
        **engine_args: Any,
    ) -> None:
        if engine is not None and (model_path is not None or engine_args):
            raise ValueError(
                "Runtime: pass either engine= or model_path / engine arguments, not both"
            )
        self._owns_engine = engine is None
        if engine is None:
            from plait.runtime.engine import Engine  # NOTE: lazy: torch loads only when used

            engine = Engine(model_path, **engine_args)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._template = resolve_chat_template(chat_template, self._model_template())

    def _model_template(self) -> ChatTemplate:
        tok = self.tokenizer
        if tok.chat_template is None:
            return CHATML

        def render(messages: list[dict[str, Any]]) -> str:
            return tok.apply_chat_template(messages, add_generation_prompt=False)

        bos = tok.bos_token if tok.add_bos_token else None  # the engine adds BOS itself
        return RenderedChatTemplate(render, name=str(self.engine.model_path), strip_leading=bos)

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
        return self.engine.generate(
            text=text,
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            rid=rid,
        )

    def generate_stream(
        self, text: str, sampling_params: dict[str, Any], *, rid: str | None = None
    ) -> Iterator[dict[str, Any]]:
        return self.engine.generate(
            text=text, sampling_params=sampling_params, stream=True, rid=rid
        )

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def count_prompt_tokens(self, text: str, rid: str | None = None) -> int:
        return len(self.tokenizer.encode(text))

    def shutdown(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()
