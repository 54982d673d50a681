"""The backend interface: what the interpreter needs from whatever runs the model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from plait.interpreter.chat_template import CHATML, ChatTemplate
from plait.interpreter.errors import UnsupportedFeatureError
from plait.interpreter.run import run_program, run_program_batch
from plait.lang.sampling import SamplingSpec

if TYPE_CHECKING:
    from plait.interpreter.state import ProgramState
    from plait.lang.program import Program

FEATURES = frozenset({"stream", "logprobs", "abort", "regex", "json_schema", "ebnf"})


class Backend(ABC):
    """Runs model calls in the native protocol (docs/server.md; docs/architecture.md, "Protocols")
    for the interpreter.

    - `generate` takes the full text every time (the runtime's prefix cache makes resending
      free) and returns the native response dict `{text, output_ids, meta_info}`; a list of
      texts gives a list of responses, in order.
    - Every method may be called concurrently from many threads.
    - A backend lacking a feature leaves it out of `features`; the interpreter then raises
      `UnsupportedFeatureError` naming it instead of sending a request that cannot work.
    - `abort(rid)` is best effort: the aborted call returns early with finish_reason `abort`.

    Backends also run programs (`run_program`), which makes any backend usable as
    `program.run(backend=...)` and as `plait.set_default_backend(...)`.
    """

    name: str = "backend"
    features: frozenset[str] = FEATURES

    @abstractmethod
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
    ) -> dict[str, Any] | list[dict[str, Any]]: ...

    def generate_stream(
        self, text: str, sampling_params: dict[str, Any], *, rid: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Chunks with cumulative `text`; the last one carries `finish_reason`."""
        raise UnsupportedFeatureError(self.name, "stream")

    def abort(self, rid: str) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Stop request `rid` if it is still running."""

    def chat_template(self) -> ChatTemplate:
        return CHATML

    def count_prompt_tokens(self, text: str, rid: str | None = None) -> int:
        """Tokens in `text` as the model sees it. This default asks the backend with a
        prefill-only call (which also warms its prefix cache, as SGLang's frontend does)."""
        out = self.generate(text, {"max_new_tokens": 0}, rid=rid)
        assert isinstance(out, dict)
        return int(out["meta_info"]["prompt_tokens"])

    def cache_prefix(self, text: str, rid: str | None = None) -> None:
        """Prefill `text` without generating, so later calls that start with it hit the cache."""
        self.generate(text, {"max_new_tokens": 0}, rid=rid)

    def require(self, feature: str, needed_by: str = "") -> None:
        if feature not in self.features:
            raise UnsupportedFeatureError(self.name, feature, needed_by)

    def shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what the backend owns (an engine, connections)."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # running programs (the `plait.lang.Runner` protocol) ------------------------------------

    def run_program(
        self, program: Program, arguments: dict[str, Any], *, stream: bool, defaults: SamplingSpec
    ) -> ProgramState:
        return run_program(self, program, arguments, stream=stream, defaults=defaults)

    def run_program_batch(
        self,
        program: Program,
        batch: list[dict[str, Any]],
        *,
        defaults: SamplingSpec,
        num_threads: int | str,
        progress_bar: bool,
    ) -> list[ProgramState]:
        return run_program_batch(
            self,
            program,
            batch,
            defaults=defaults,
            num_threads=num_threads,
            progress_bar=progress_bar,
        )
