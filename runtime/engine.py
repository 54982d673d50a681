"""`Engine`: the public entry to plait's runtime. It validates requests, attaches their grammars
and submits them to its `EngineCore` (`engine_core.py`), whose one background thread runs the
step loop; `generate` / `async_generate` may be called from any number of threads or coroutines.

An `Engine` is released (thread stopped, weights and KV pool let go) by `shutdown()`, at the end
of a `with` block, or when it is garbage-collected."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from plait.kernels.openmp import release_thread_team
from plait.runtime.config import EngineConfig
from plait.runtime.engine_core import EngineCore
from plait.runtime.engine_setup import off_main_thread, resolve_device, resolve_dtype
from plait.runtime.events import RequestSubmitted
from plait.runtime.protocol import LogprobOptions
from plait.runtime.request import Request
from plait.runtime.request_builder import build_requests
from plait.runtime.tuning import (
    CLOSING_PROBE_SECONDS,
    CLOSING_PROBE_TOKENS,
    GIL_FREE_CHARS,
    SPECULATIVE_BURST_STEPS,
)

if TYPE_CHECKING:
    import torch

    from plait.runtime.events import EngineEvents
    from plait.runtime.models.args import ModelArgs
    from plait.runtime.tokenizer import Tokenizer

__all__ = [
    "SPECULATIVE_BURST_STEPS",
    "Engine",
    "off_main_thread",
    "resolve_device",
    "resolve_dtype",
]


def _text_chars(text: Any) -> int:
    if isinstance(text, str):
        return len(text)
    return sum(len(t) for t in text if isinstance(t, str)) if isinstance(text, list) else 0


class Engine:
    """An in-process model server: `generate` / `async_generate` from any thread or coroutine,
    `stats()`, `events`. The loop's parts (scheduler, runner, KV pool, cache) are `core`'s."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        self.core = core = EngineCore(self.config)
        # NOTE: the finalizer holds the core, never the Engine: dropping the last reference to
        # the Engine stops the loop and frees the model and KV pool.
        self._finalizer = weakref.finalize(self, core.shutdown)
        release_thread_team()  # a team the builder's thread left would slow every step's regions

    # what a user of the engine reads ----------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (encode, decode, chat template, EOS ids)."""
        return self.core.tokenizer

    @property
    def model_path(self) -> str:
        """Where the checkpoint was loaded from: the `.gguf` file or the Hugging Face folder."""
        return self.core.model_path

    @property
    def context_len(self) -> int:
        """The most tokens a request may hold, prompt and output together."""
        return self.core.context_len

    @property
    def args(self) -> ModelArgs:
        """The model's shape (layers, heads, vocabulary); under tensor parallelism, rank 0's."""
        return self.core.args

    @property
    def device(self) -> torch.device:
        """The device the model runs on."""
        return self.core.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype."""
        return self.core.dtype

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        return self.core.page_size

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype."""
        return self.core.kv_dtype

    @property
    def events(self) -> EngineEvents:
        """Subscribe to what the engine does (`runtime/events.py`)."""
        return self.core.events

    @property
    def handoff(self) -> Any:
        """Prefill–decode disaggregation: this engine's prefill-and-export and import of
        prompts' KV (`runtime/handoff.py`)."""
        from plait.runtime.handoff import Handoff

        return Handoff(self)

    # submitting ------------------------------------------------------------------------------

    def _make_requests(self, *args: Any) -> tuple[list[Request], bool]:
        return build_requests(self.core, *args)

    # constraints -------------------------------------------------------------------------------

    def _grammar_cache(self) -> Any:
        return self.core.constraint_tools.result().grammars

    def _grammar_futures(self, reqs: list[Request]) -> list[tuple[Request, Any]]:
        """Starts compiling each constrained request's grammar (off the engine loop)."""
        from plait.runtime.constrained import make_grammar_key

        pending = []
        for req in reqs:
            p = req.sampling.params
            self._heal(req)
            if (
                p.regex is None
                and p.json_schema is None
                and p.ebnf is None
                and not req.healing.text
            ):
                continue
            key = make_grammar_key(
                regex=p.regex,
                json_schema=p.json_schema,
                grammar=p.ebnf,
                json_whitespace=p.json_whitespace or self.config.json_whitespace,
                prefix=req.healing.text,
            )
            pending.append((req, self._grammar_cache().get_future(key)))
        return pending

    def _heal(self, req: Request) -> None:
        """Token healing (`constrained/healing.py`): not with logprobs (they index the prompt
        as sent) or without output."""
        p = req.sampling.params
        if not p.token_healing or req.sampling.logprob.return_logprob or p.max_new_tokens == 0:
            return
        healing = self.core.constraint_tools.result().healer.heal(req.prompt_ids)
        if healing is not None:
            req.prompt_ids = healing.prompt_ids
            req.healing.text = healing.text
            req.healing.free = p.regex is None and p.json_schema is None and p.ebnf is None

    def _closing_search(self) -> Any:
        return self.core.closing_search()

    def _start_grammar(self, req: Request, compiled: Any) -> None:
        """Gives `req` its grammar state; with budget-aware closing, checks that the shortest
        output the grammar accepts fits `max_new_tokens` (a `GrammarError` if not)."""
        from plait.runtime.constrained import GrammarError

        req.constraint.grammar = compiled.new_grammar()
        p = req.sampling.params
        enabled = self.config.budget_closing if p.budget_closing is None else p.budget_closing
        req.closing.applies = (
            enabled and p.max_new_tokens > 0 and not p.ignore_eos and not req.healing.free
        )
        if not req.closing.applies:
            return
        if not compiled.probed:  # once per grammar: every request of it shares the result
            found = self._closing_search().shortest_completion(
                req.constraint.grammar, CLOSING_PROBE_TOKENS, time_limit=CLOSING_PROBE_SECONDS
            )
            compiled.shortest_output = None if found is None else tuple(found)
            compiled.probed = True
        shortest = compiled.shortest_output
        if shortest is not None and len(shortest) > p.max_new_tokens:
            # the probe's output is short, not always the shortest: look within the budget
            found = self._closing_search().shortest_completion(
                req.constraint.grammar, p.max_new_tokens, time_limit=CLOSING_PROBE_SECONDS
            )
            shortest = shortest if found is None else tuple(found)
        if shortest is not None and len(shortest) > p.max_new_tokens:
            raise GrammarError(
                f"max_new_tokens: the constraint's shortest output takes {len(shortest)} tokens, "
                f"more than max_new_tokens ({p.max_new_tokens})"
            )
        self.core.closing.start(req, None if shortest is None else list(shortest))

    def _attach_grammars(self, reqs: list[Request]) -> None:
        """Blocks the caller (never the engine loop) until the grammars compiled; raises their
        errors, and a `GrammarError` for one that takes longer than `grammar_compile_timeout`."""
        limit = self.config.grammar_compile_timeout
        for req, future in self._grammar_futures(reqs):
            try:
                compiled = future.result(timeout=limit)
            except concurrent.futures.TimeoutError:
                raise _compile_timeout(req, limit) from None
            self._start_grammar(req, compiled)

    async def _attach_grammars_async(self, reqs: list[Request]) -> None:
        limit = self.config.grammar_compile_timeout
        for req, future in self._grammar_futures(reqs):
            # NOTE: shielded: the compilation is shared with other requests of the same pattern.
            waiter = asyncio.shield(asyncio.wrap_future(future))
            try:
                compiled = await asyncio.wait_for(waiter, timeout=limit)
            except asyncio.TimeoutError:
                raise _compile_timeout(req, limit) from None
            if not compiled.probed and req.sampling.params.max_new_tokens:
                await asyncio.to_thread(self._start_grammar, req, compiled)  # the closing probe
            else:
                self._start_grammar(req, compiled)

    def _submit(self, reqs: list[Request]) -> None:
        if self.core.stopped:
            raise RuntimeError("Engine: already shut down")
        if not self.core.on_loop_thread():
            release_thread_team()  # one the submitter left (kernels/openmp.py)
        events = self.core.events
        if events.wants(RequestSubmitted):  # on the caller's thread: its context is still there
            now = time.perf_counter()
            for req in reqs:
                events.emit(
                    RequestSubmitted(
                        now, req.rid, len(req.prompt_ids), req.sampling.params.max_new_tokens, req
                    )
                )
        self.core.post("add", reqs)  # one message: submitted together, scheduled together

    def abort(self, rid: str) -> None:
        self.core.post("abort", rid)

    def generate(
        self,
        text: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        timeout: float | None = None,
        client_id: str | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generates for one prompt (a dict back) or a list (a list back); `stream` yields chunks.

        `timeout`: seconds from now after which the engine aborts the request (its result is an
        abort with `status_code` 504). `client_id`: whom it is for; the scheduler admits the
        waiting requests of different clients round-robin."""
        opts = LogprobOptions(
            return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs
        )
        reqs, batched = self._make_requests(
            text, input_ids, sampling_params, opts, rid, timeout, client_id
        )
        self._attach_grammars(reqs)
        if stream:
            return self._stream(reqs, batched)
        events: queue.Queue[tuple[int, dict, bool]] = queue.Queue()
        self._start(reqs, events.put, stream=False)
        results: list[dict | None] = [None] * len(reqs)
        try:
            for _ in reqs:
                index, out, _final = events.get()
                results[index] = out
        except BaseException:
            self._abort_all(reqs)
            raise
        return results if batched else results[0]

    def _start(
        self, reqs: list[Request], put: Callable[[tuple[int, dict, bool]], None], stream: bool
    ) -> None:
        """The one way requests go in, under `generate`, `async_generate` and their streams:
        each one's updates reach `put` as (index, output, final), every update when streaming,
        the final one otherwise."""
        for i, req in enumerate(reqs):
            req.delivery.sink = _indexed_sink(put, i, stream_all=stream)
            req.delivery.streaming = stream
        self._submit(reqs)

    def _abort_all(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.abort(r.rid)

    def _stream(self, reqs: list[Request], batched: bool) -> Iterator[dict]:
        # NOTE: a generator: the requests go in when the caller starts iterating
        events: queue.Queue[tuple[int, dict, bool]] = queue.Queue()
        self._start(reqs, events.put, stream=True)
        remaining = len(reqs)
        try:
            while remaining:
                index, out, final = events.get()
                remaining -= final
                if batched:
                    out["index"] = index
                yield out
        finally:
            if remaining:
                self._abort_all(reqs)

    async def async_generate(self, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
        """Like `generate`; with `stream=True` returns an async iterator of chunks."""
        opts = LogprobOptions(
            kwargs.pop("return_logprob", False),
            kwargs.pop("logprob_start_len", -1),
            kwargs.pop("top_logprobs_num", 0),
            kwargs.pop("return_text_in_logprobs", False),
        )
        if len(args) > 2:
            raise TypeError("async_generate: pass at most text and sampling_params positionally")
        text = kwargs.pop("text", args[0] if args else None)
        if len(args) == 2:
            kwargs["sampling_params"] = args[1]
        make_args = (
            text,
            kwargs.pop("input_ids", None),
            kwargs.pop("sampling_params", None),
            opts,
            kwargs.pop("rid", None),
            kwargs.pop("timeout", None),
            kwargs.pop("client_id", None),
        )
        if kwargs:
            raise TypeError(f"async_generate: unknown argument(s) {', '.join(kwargs)}")
        if _text_chars(text) >= GIL_FREE_CHARS:  # long prompts tokenize off the event loop
            reqs, batched = await asyncio.to_thread(self._make_requests, *make_args)
        else:
            reqs, batched = self._make_requests(*make_args)
        await self._attach_grammars_async(reqs)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, dict, bool]] = asyncio.Queue()

        def put(item: tuple[int, dict, bool]) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        self._start(reqs, put, stream)
        if stream:
            return self._astream(reqs, events, batched)
        results: list[dict | None] = [None] * len(reqs)
        try:
            for _ in reqs:
                index, out, _final = await events.get()
                results[index] = out
        except BaseException:
            self._abort_all(reqs)
            raise
        return results if batched else results[0]

    async def _astream(
        self, reqs: list[Request], events: asyncio.Queue, batched: bool
    ) -> AsyncIterator[dict]:
        remaining = len(reqs)
        try:
            while remaining:
                index, out, final = await events.get()
                remaining -= final
                if batched:
                    out["index"] = index
                yield out
        finally:
            if remaining:
                self._abort_all(reqs)

    # introspection and shutdown ----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are running or waiting."""
        return self.core.flush_cache()

    def shutdown(self) -> None:
        """Stops the engine: unfinished requests end as aborted (503), the loop thread exits and
        the weights and KV pool are let go. Idempotent; `with Engine(...)` calls it on exit, and
        garbage collection does for an Engine that is dropped."""
        self._finalizer()
        self.core.shutdown()  # a no-op after the first; drains what raced in since

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _compile_timeout(req: Request, limit: float) -> ValueError:
    from plait.runtime.constrained import GrammarError

    p = req.sampling.params
    name = "regex" if p.regex is not None else "ebnf" if p.ebnf is not None else "json_schema"
    return GrammarError(
        f"{name}: compiling the constraint took longer than {limit:g} s; simplify it"
    )


def _indexed_sink(
    put: Callable[[tuple[int, dict, bool]], None], index: int, stream_all: bool
) -> Callable[[dict, bool], None]:
    def deliver(out: dict, final: bool) -> None:
        if final or stream_all:
            put((index, out, final))

    return deliver
