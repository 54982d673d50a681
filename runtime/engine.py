"""`Engine`: the public entry to plait's runtime. One background thread runs the step loop;
`generate` / `async_generate` may be called from any number of threads or coroutines."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import itertools
import logging
import queue
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch

from plait.kernels.kv_cache import resolve_kv_dtype
from plait.radix_cache import PageAllocator, RadixCache
from plait.runtime import lifecycle
from plait.runtime.config import EngineConfig
from plait.runtime.governor import ThreadGovernor
from plait.runtime.kv_pool import KVPool
from plait.runtime.model_loader import load_model
from plait.runtime.model_runner import ModelRunner, ScheduleBatch
from plait.runtime.models.quantized import weight_bytes
from plait.runtime.output_processor import OutputProcessor
from plait.runtime.outputs import build_output
from plait.runtime.protocol import FinishReason, LogprobOptions, SamplingParams
from plait.runtime.request import Request
from plait.runtime.scheduler import Scheduler
from plait.runtime.speculative.governor import SpeculationGovernor
from plait.runtime.tuning import (
    BURST_SECONDS,
    CLOSING_GROWTH,
    CLOSING_PROBE_SECONDS,
    CLOSING_PROBE_TOKENS,
    GIL_FREE_CHARS,
    SPECULATIVE_BURST_STEPS,
)

logger = logging.getLogger("plait.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _text_chars(text: Any) -> int:
    if isinstance(text, str):
        return len(text)
    return sum(len(t) for t in text if isinstance(t, str)) if isinstance(text, list) else 0


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # NOTE: CPUs without native bf16 run bf16 matmuls ~170x slower than float32.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "float16" and device.type == "cpu":
        raise ValueError("dtype: float16 is only supported on GPUs; use float32 or bfloat16")
    return _DTYPES[name]


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        mc = self.config.model
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        loaded = off_main_thread(load_model, mc.model_path, self.dtype, self.device, mc.quantization)
        self.model, self.args, self.tokenizer = loaded.model, loaded.args, loaded.tokenizer
        self.tp: Any = None
        if self.config.tp_size > 1:
            from plait.runtime.tensor_parallel import start_tensor_parallel

            self.tp = start_tensor_parallel(self.model, self.config, self.device)
            self.model, self.args = self.tp.model, self.tp.args  # args: this rank's heads
        self.model_path = loaded.location.path
        self.context_len = mc.context_length or self.args.max_position_embeddings
        self.weight_bytes = weight_bytes(self.model)  # read by one decode step: the roofline
        cc = self.config.cache
        self.page_size = cc.page_size
        self.kv_dtype = resolve_kv_dtype(cc.kv_cache_dtype, self.dtype, self.device, mc.quantization is not None)
        num_pages = self._num_pages()
        self.kv_pool = KVPool(
            num_pages, cc.page_size, self.args.num_layers, self.args.num_kv_heads,
            self.args.head_dim, self.kv_dtype, self.device,
        )
        if self.tp is not None:
            self.tp.start_workers(num_pages, cc.page_size)
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(cc.page_size, self.allocator, disable=cc.disable_radix_cache)
        self.scheduler = Scheduler(
            self.config.scheduler, self.allocator, self.cache, cc.page_size, self.context_len
        )
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.random_seed)
        self.runner = ModelRunner(
            self.model, self.kv_pool, self.device, self.tokenizer.eos_token_ids, self.generator
        )
        self.processor = OutputProcessor(self.tokenizer, self.context_len)
        self.drafter = self._make_drafter()
        self.governor = SpeculationGovernor()
        threads = torch.get_num_threads()
        # NOTE: on GPUs the CPU threads only feed kernel launches; nothing to tune there.
        self.thread_governor = ThreadGovernor(threads) if self.device.type == "cpu" and threads > 1 else None
        self._spec_totals = {"steps": 0, "proposed": 0, "accepted": 0}
        self._grammars: Any = None  # GrammarCache, made on the first constrained request
        self._grammar_lock = threading.Lock()
        self._closing: Any = None  # ClosingSearch, made with the first closing request
        self._healer: Any = None  # TokenHealer, made with the first healed request
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        # set by `_post` from any thread: a running decode burst ends after its current step
        self._interrupt = ctypes.c_int32(0)
        self._decode_step_s: float | None = None  # the last decode-only step's forward time
        self._counter = itertools.count()
        self._stopped = threading.Event()
        self._totals = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "burst_steps": 0}
        self._thread = threading.Thread(target=self._loop, name="plait-engine", daemon=True)
        self._thread.start()

    def _num_pages(self) -> int:
        cc = self.config.cache
        if cc.max_total_tokens is not None:
            return cc.max_total_tokens // cc.page_size
        per_token = KVPool.bytes_per_token(
            self.args.num_layers, self.args.num_kv_heads, self.args.head_dim, self.kv_dtype
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * (cc.mem_fraction_static or 0.8)
        else:
            import os

            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            budget = total * (cc.mem_fraction_static or 0.1)
        tokens = int(budget // per_token)
        tokens = max(min(tokens, 64 * self.context_len), self.context_len)
        return tokens // cc.page_size

    # submitting ------------------------------------------------------------------------------

    def _make_requests(
        self,
        text: str | list[str] | None,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: dict | list[dict] | None,
        logprob: LogprobOptions,
        rid: str | list[str] | None,
        timeout: float | None = None,
        client_id: str | None = None,
    ) -> tuple[list[Request], bool]:
        if (text is None) == (input_ids is None):
            raise ValueError("text, input_ids: pass exactly one of them")
        logprob.validate()
        timeout = lifecycle.check_timeout(timeout)
        # NOTE: every shape is checked before it is indexed or iterated: a JSON object or a number
        # where a list belongs is the caller's mistake (ValueError naming it), not a KeyError.
        source = "text" if text is not None else "input_ids"
        if text is not None:
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not texts:
                raise ValueError("text: the list of prompts is empty")
            wrong = [type(t).__name__ for t in texts if not isinstance(t, str)]
            if wrong:
                raise ValueError(f"text: expected a string or a list of strings, got {wrong[0]}")
            # NOTE: the batch call releases the GIL and spreads the texts over the cores.
            prompts = self.tokenizer.encode_batch(texts) if len(texts) > 1 else [self.tokenizer.encode(texts[0])]
        else:
            if not isinstance(input_ids, list):
                raise ValueError(
                    "input_ids: expected a list of token ids or a list of such lists, got "
                    f"{type(input_ids).__name__}"
                )
            batched = bool(input_ids) and isinstance(input_ids[0], list)
            prompts = input_ids if batched else [input_ids]
            for p in prompts:
                if not isinstance(p, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p
                ):
                    raise ValueError("input_ids: expected a list of integers or a list of such lists")
                bad = [t for t in p if not 0 <= t < self.args.vocab_size]
                if bad:
                    raise ValueError(
                        f"input_ids: token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})"
                    )
        # NOTE: SamplingParams turns `stop` and `stop_token_ids` into lists before it checks them.
        for p in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
            for name, item in (("stop", str), ("stop_token_ids", int)):
                value = p.get(name) if isinstance(p, dict) else None
                if value is not None and not isinstance(value, (item, list, tuple)):
                    raise ValueError(
                        f"{name}: expected a {item.__name__} or a list of them, got {value!r:.80}"
                    )
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts"
                )
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(prompts)
        vocab = self.args.vocab_size
        for sp in params:
            bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})"
                )
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        if len(rids) != len(prompts):
            raise ValueError(f"rid: got {len(rids)} ids for {len(prompts)} prompts")
        reqs: list[Request] = []
        for prompt, sp, r in zip(prompts, params, rids):
            if not prompt:
                raise ValueError(f"{source}: the prompt is empty (no tokens)")
            if len(prompt) >= self.context_len:
                raise ValueError(
                    f"{source}: the prompt has {len(prompt)} tokens, but the model's context length is "
                    f"{self.context_len} (prompt + output must fit)"
                )
            for i in range(sp.n):
                req_rid = r or uuid.uuid4().hex
                if sp.n > 1:
                    req_rid = f"{req_rid}-{i}"
                req = Request(rid=req_rid, prompt_ids=list(prompt), params=sp, logprob=logprob,
                              client_id=client_id or "")  # fmt: skip
                if timeout is not None:
                    req.deadline = req.arrival_time + timeout
                if sp.seed is not None:
                    req.generator = torch.Generator(device=self.device).manual_seed(sp.seed + i)
                if not self.scheduler.fits_pool(req):
                    raise ValueError(
                        f"max_new_tokens: the request needs KV for {self.scheduler.max_tokens(req)} "
                        f"tokens but the pool holds {self.allocator.num_total * self.page_size}"
                    )
                reqs.append(req)
        return reqs, batched or len(reqs) > 1

    # speculative decoding ------------------------------------------------------------------------

    def _make_drafter(self) -> Any:
        algo = self.config.speculative_algorithm
        if algo is None:
            return None
        from plait.runtime.speculative import create_drafter

        return create_drafter(algo, engine=self)

    def _propose_drafts(self, batch: ScheduleBatch) -> None:
        candidates = [r for r in batch.decodes if self.drafter.wants(r)]
        if not candidates:
            return
        k = self.config.num_draft_tokens
        drafts: dict[int, list[int]] = {}
        for req, draft in zip(candidates, self.drafter.propose(candidates, k)):
            room = min(
                req.params.max_new_tokens - len(req.output_ids) - 1,
                self.context_len - req.num_tokens - 1,
            )
            draft = draft[: max(room, 0)]
            if draft and req.grammar is not None:
                grammar = req.grammar.copy()
                allowed = 0
                while allowed < len(draft) and grammar.try_advance(draft[allowed]):
                    allowed += 1
                draft = draft[:allowed]
            if draft:
                drafts[id(req)] = draft
        self.scheduler.add_drafts(batch, drafts)

    def _observe_speculation(self, req: Request, proposed: int, accepted: int) -> None:
        self.drafter.observe(req, proposed, accepted)
        req.spec.num_steps += 1
        req.spec.num_proposed += proposed
        req.spec.num_accepted += accepted
        self._spec_totals["steps"] += 1
        self._spec_totals["proposed"] += proposed
        self._spec_totals["accepted"] += accepted

    # constraints -------------------------------------------------------------------------------

    def _grammar_cache(self) -> Any:
        with self._grammar_lock:
            if self._grammars is None:
                from plait.runtime.constrained import GrammarCache, create_grammar_backend

                cfg = self.config
                sandboxed = cfg.grammar_compile_memory_mb > 0
                backend = create_grammar_backend(
                    cfg.grammar_backend, self.tokenizer, vocab_size=self.args.vocab_size,
                    max_digit_run=cfg.json_max_digit_run,
                    max_whitespace_run=cfg.json_max_whitespace_run,
                    **({"compile_timeout": cfg.grammar_compile_timeout,
                        "compile_memory_mb": cfg.grammar_compile_memory_mb} if sandboxed else {}),
                )  # fmt: skip
                self._grammars = GrammarCache(backend)
            return self._grammars

    def _grammar_futures(self, reqs: list[Request]) -> list[tuple[Request, Any]]:
        """Starts compiling each constrained request's grammar (off the engine loop)."""
        from plait.runtime.constrained import make_grammar_key

        pending = []
        for req in reqs:
            p = req.params
            self._heal(req)
            if p.regex is None and p.json_schema is None and p.ebnf is None and not req.healed_text:
                continue
            key = make_grammar_key(
                regex=p.regex, json_schema=p.json_schema, grammar=p.ebnf,
                whitespace_pattern=self.config.json_whitespace_pattern, prefix=req.healed_text,
            )
            pending.append((req, self._grammar_cache().get_future(key)))
        return pending

    def _heal(self, req: Request) -> None:
        """Token healing (`constrained/healing.py`): not with logprobs (they index the prompt
        as sent) or without output."""
        p = req.params
        if not p.token_healing or req.logprob.return_logprob or p.max_new_tokens == 0:
            return
        if self._healer is None:
            from plait.runtime.constrained.healing import TokenHealer

            self._healer = TokenHealer(self.tokenizer)
        healing = self._healer.heal(req.prompt_ids)
        if healing is not None:
            req.prompt_ids = healing.prompt_ids
            req.healed_text = healing.text
            req.heal_free = p.regex is None and p.json_schema is None and p.ebnf is None

    def _closing_search(self) -> Any:
        if self._closing is None:
            from plait.runtime.constrained.closing import ClosingSearch

            self._closing = ClosingSearch(
                self.tokenizer.vocab_bytes(), (self.args.vocab_size + 31) // 32,
                excluded=self.tokenizer.special_token_ids | self.tokenizer.eos_token_ids,
            )  # fmt: skip
        return self._closing

    @property
    def _closing_slack(self) -> int:
        """Tokens one step may add to a constrained request, plus a few for what they may open."""
        drafts = self.config.num_draft_tokens if self.drafter is not None else 0
        return 1 + drafts + CLOSING_GROWTH

    def _start_grammar(self, req: Request, compiled: Any) -> None:
        """Gives `req` its grammar state; with budget-aware closing, checks that the shortest
        output the grammar accepts fits `max_new_tokens` (a `GrammarError` if not)."""
        from plait.runtime.constrained import GrammarError

        req.grammar = compiled.new_grammar()
        p = req.params
        enabled = self.config.budget_closing if p.budget_closing is None else p.budget_closing
        req.closing = enabled and p.max_new_tokens > 0 and not p.ignore_eos and not req.heal_free
        if not req.closing:
            return
        shortest = getattr(compiled, "shortest_output", None)
        if shortest is None:
            found = self._closing_search().shortest_completion(
                req.grammar, CLOSING_PROBE_TOKENS, time_limit=CLOSING_PROBE_SECONDS
            )
            shortest = -1 if found is None else len(found)
            compiled.shortest_output = shortest  # shared by every request of the grammar
        if shortest > p.max_new_tokens:
            raise GrammarError(
                f"max_new_tokens: the constraint's shortest output takes {shortest} tokens, "
                f"more than max_new_tokens ({p.max_new_tokens})"
            )
        req.closing_tokens = max(shortest, 0)

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
            if getattr(compiled, "shortest_output", None) is None and req.params.max_new_tokens:
                await asyncio.to_thread(self._start_grammar, req, compiled)  # the closing probe
            else:
                self._start_grammar(req, compiled)

    def _submit(self, reqs: list[Request]) -> None:
        if self._stopped.is_set():
            raise RuntimeError("Engine: already shut down")
        self._post("add", reqs)  # one message: requests submitted together are scheduled together

    def _post(self, kind: str, item: Any) -> None:
        self._inbox.put((kind, item))
        self._interrupt.value = 1

    def abort(self, rid: str) -> None:
        self._post("abort", rid)

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
        opts = LogprobOptions(return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs)
        reqs, batched = self._make_requests(
            text, input_ids, sampling_params, opts, rid, timeout, client_id
        )
        self._attach_grammars(reqs)
        if stream:
            return self._stream(reqs, batched)
        sinks = [self._attach_queue(r, stream=False) for r in reqs]
        self._submit(reqs)
        try:
            results = [s.get() for s in sinks]
        except BaseException:
            for r in reqs:
                self.abort(r.rid)
            raise
        return results if batched else results[0]

    def _stream(self, reqs: list[Request], batched: bool) -> Iterator[dict]:
        events: queue.Queue[tuple[int, dict, bool]] = queue.Queue()
        for i, req in enumerate(reqs):
            req.sink = _indexed_sink(events.put, i)
        self._submit(reqs)
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
                for r in reqs:
                    self.abort(r.rid)

    def _attach_queue(self, req: Request, stream: bool) -> queue.Queue:
        q: queue.Queue = queue.Queue()

        def deliver(out: dict, final: bool) -> None:
            if final or stream:
                q.put(out)

        req.sink = deliver
        return q

    async def async_generate(self, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
        """Like `generate`; with `stream=True` returns an async iterator of chunks."""
        opts = LogprobOptions(
            kwargs.pop("return_logprob", False), kwargs.pop("logprob_start_len", -1),
            kwargs.pop("top_logprobs_num", 0), kwargs.pop("return_text_in_logprobs", False),
        )
        if len(args) > 2:
            raise TypeError("async_generate: pass at most text and sampling_params positionally")
        text = kwargs.pop("text", args[0] if args else None)
        if len(args) == 2:
            kwargs["sampling_params"] = args[1]
        make_args = (text, kwargs.pop("input_ids", None), kwargs.pop("sampling_params", None), opts,
                     kwargs.pop("rid", None), kwargs.pop("timeout", None), kwargs.pop("client_id", None))  # fmt: skip
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

        for i, req in enumerate(reqs):
            req.sink = _indexed_sink(put, i, stream_all=stream)
        self._submit(reqs)
        if stream:
            return self._astream(reqs, events, batched)
        results: list[dict | None] = [None] * len(reqs)
        try:
            for _ in reqs:
                index, out, _final = await events.get()
                results[index] = out
        except BaseException:
            for r in reqs:
                self.abort(r.rid)
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
                for r in reqs:
                    self.abort(r.rid)

    # the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._run_loop()
        finally:
            if self.thread_governor is not None:  # the thread count is the process's: give it back
                torch.set_num_threads(self.thread_governor.threads)

    def _run_loop(self) -> None:
        while not self._stopped.is_set():
            block = not self.scheduler.has_work()
            self._interrupt.value = 0  # before draining: a message posted after this ends a burst
            try:
                kind, item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                kind = None
            # NOTE: nothing may escape this loop: a dead engine thread would leave every caller
            # waiting forever. A failed step fails the requests it held, then the loop goes on.
            try:
                while kind is not None:
                    self._handle(kind, item)
                    try:
                        kind, item = self._inbox.get_nowait()
                    except queue.Empty:
                        kind = None
                lifecycle.expire(self)
                if self.scheduler.has_work():
                    self.step()
            except Exception as exc:
                lifecycle.recover(self, exc)
        lifecycle.drain(self, self._inbox)

    def _handle(self, kind: str, item: Any) -> None:
        if kind == "add":
            for req in item:
                self._totals["requests"] += 1
                self._totals["prompt_tokens"] += len(req.prompt_ids)
                try:
                    self.processor.start(req)
                    self.scheduler.add(req)
                except Exception as exc:
                    status = 400 if isinstance(exc, ValueError) else 500
                    self.processor.finish(
                        req, FinishReason("abort", message=str(exc), status_code=status)
                    )
                    self._deliver(req)
        elif kind == "abort":
            req = self.scheduler.abort(item)
            if req is not None and not req.finished:
                self.processor.finish(req, FinishReason("abort", message="aborted by the client"))
                self._deliver(req)
        elif kind == "flush":
            done, outcome = item
            ok = not self.scheduler.has_work()
            if ok:
                self.cache.reset()
            outcome.append(ok)
            done.set()
        elif kind == "stop":
            self._stopped.set()

    def step(self) -> None:
        """One forward pass over the scheduler's next batch, then bookkeeping and delivery."""
        batch = self.scheduler.schedule()
        started = time.perf_counter()
        plain_decode = not batch.extends  # a step the speculation governor can learn from
        speculating = (
            self.drafter is not None and bool(batch.decodes) and self.governor.speculate(len(batch.decodes))
        )
        if speculating:
            self._propose_drafts(batch)
        if not batch:
            return
        num_tokens = batch.num_tokens
        threads = self._choose_threads(num_tokens)
        forward_started = time.perf_counter()
        try:
            burst = self._burst_steps(batch, speculating)
            if burst > 1:
                results = self.runner.decode_burst(batch, burst, self._interrupt)
                batch.decode_steps = max(len(r.tokens) for r in results)
                self._totals["burst_steps"] += batch.decode_steps
            else:
                results = self.runner.forward(batch)
        except Exception as exc:  # a failing batch must not take the engine down
            logger.error("forward pass failed: %s", traceback.format_exc())
            reqs = [e.req for e in batch.extends] + batch.decodes
            if len({id(r) for r in reqs}) > 1:
                self.scheduler.quarantine(reqs)  # retried one by one: only the culprit fails
            else:
                self._fail(batch, f"internal error: {type(exc).__name__}: {exc}")
            return
        step_s = (time.perf_counter() - forward_started) / batch.decode_steps
        if not batch.extends:
            self._decode_step_s = step_s
        if threads:
            self.thread_governor.record(num_tokens, threads, step_s)
        self._totals["steps"] += batch.decode_steps
        entries = [e.req for e in batch.extends] + batch.decodes
        last_chunk = [e.is_last_chunk for e in batch.extends] + [True] * len(batch.decodes)
        updated: list[Request] = []
        if self.drafter is not None and plain_decode and entries:
            # verifying drafts against bursts: a step the drafter found nothing for counts as a
            # plain one (a short burst), whoever chose it
            verified = any(e.draft_ids for e in batch.extends)
            tokens = sum(len(r.tokens) for r in results)
            self.governor.record(
                len(entries), verified, tokens, time.perf_counter() - started, steps=batch.decode_steps
            )
        for entry, req, result, done_prompt in zip(
            [*batch.extends, *[None] * len(batch.decodes)], entries, results, last_chunk
        ):
            if req.finished:
                continue
            self.processor.record_input_logprobs(req, result)
            if result.tokens:
                if req.first_token_time is None:
                    req.first_token_time = time.perf_counter()
                added = self.processor.append_tokens(req, result)
                self._totals["generated_tokens"] += added
                if entry is not None and entry.draft_ids:
                    entry.num_accepted = min(len(result.tokens) - 1, added)
                    self._observe_speculation(req, len(entry.draft_ids), len(result.tokens) - 1)
                updated.append(req)
            elif done_prompt:
                self.processor.finish(req, FinishReason("length", length=len(req.output_ids)))
                updated.append(req)
        # NOTE: pages are released before results are delivered, so a caller that got its
        # result sees the pool without that request.
        self.scheduler.after_step(batch)
        for req in updated:
            self._close_or_jump(req)
        if self.config.check_invariants:
            self.scheduler.check()
        for req in updated:
            self._deliver(req)

    def _burst_steps(self, batch: ScheduleBatch, speculating: bool = False) -> int:
        """Decode steps to run back to back in one native call (`num_continuous_decode_steps`):
        only while nothing waits to be scheduled, and no longer than ~`BURST_SECONDS` (by the last
        decode step's time), so streams still update often. With speculative decoding, a batch
        the drafter found nothing for runs `SPECULATIVE_BURST_STEPS` at most while the governor
        speculates (so that a draft is looked for again soon), and whole bursts while it does not:
        so the governor weighs drafts against bursts, not against single steps."""
        limit = self.config.scheduler.num_continuous_decode_steps
        if speculating:
            limit = min(limit, SPECULATIVE_BURST_STEPS)
        sched = self.scheduler
        if (
            limit <= 1 or self._decode_step_s is None
            or sched.waiting or sched.prefilling or sched.suspects or not self._inbox.empty()
            or not self.runner.can_burst(batch)
        ):  # fmt: skip
            return 1
        limit = min(limit, max(1, int(BURST_SECONDS / max(self._decode_step_s, 1e-6))))
        return sched.grow_for_burst(batch.decodes, limit) if limit > 1 else 1

    def _close_or_jump(self, req: Request) -> None:
        """After a step: a constrained request near its budget closes (`try_close`); others
        jump over the text their grammar forces."""
        if req.grammar is None or req.finished or req not in self.scheduler.running:
            return
        if req.closing:
            before = req.num_tokens
            if self.processor.try_close(req, self._closing_search(), self._closing_slack):
                self.scheduler.rewind(req, num_valid=before)  # finished: its pages go back
                return
        # NOTE: not over the healed text alone: that would re-append the very token healing
        # backed up over, instead of letting the model choose the merged one
        if not self.config.disable_jump_forward and not _healing(req):
            self._jump_forward(req)

    def _jump_forward(self, req: Request) -> None:
        before = req.num_tokens
        replaced = self.processor.try_jump_forward(
            req, min_kept_tokens=req.num_cached_pages * self.page_size
        )
        if replaced is not None:
            self.scheduler.rewind(req, num_valid=before - replaced)

    def _choose_threads(self, num_tokens: int) -> int | None:
        """Sets this step's CPU threads (see `governor.ThreadGovernor`); None when not governed."""
        if self.thread_governor is None:
            return None
        threads = self.thread_governor.choose(num_tokens)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads

    def _fail(self, batch: ScheduleBatch, message: str) -> None:
        for req in [e.req for e in batch.extends] + batch.decodes:
            self.scheduler.abort(req.rid, keep=False)  # its KV may be half written
            if not req.finished:
                self.processor.finish(
                    req, FinishReason("abort", message=message, status_code=500)
                )
                self._deliver(req)

    def _deliver(self, req: Request) -> None:
        if req.sink is None:
            return
        out = build_output(req, self.tokenizer, self.processor.stream_text(req))
        try:
            req.sink(out, req.finished)
        except Exception:
            logger.error("delivering request %s failed: %s", req.rid, traceback.format_exc())

    # introspection and shutdown ----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        sched = self.scheduler
        total = self.allocator.num_total
        free = self.allocator.num_free
        cached = self.cache.total_size()
        return {
            "kv_pages_total": total,
            "kv_pages_free": free,
            "kv_pages_cached": cached,
            "kv_pages_evictable": self.cache.evictable_size(),
            "kv_pages_in_use": total - free - cached,
            "page_size": self.page_size,
            "num_running": len(sched.running) + len(sched.prefilling),
            "num_waiting": len(sched.all_requests()) - len(sched.running) - len(sched.prefilling),
            "cache_hit_rate": sched.cached_prompt_tokens / sched.prompt_tokens if sched.prompt_tokens else 0.0,
            "num_retracted": sched.num_retracted,
            "total_computed_tokens": sched.computed_tokens,
            **self._spec_stats(),
            "new_token_ratio": sched.new_token_ratio,
            "quantization": self.config.model.quantization,
            "cpu_threads": torch.get_num_threads() if self.device.type == "cpu" else None,
            "weight_bytes": self.weight_bytes,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": KVPool.bytes_per_token(
                self.args.num_layers, self.args.num_kv_heads, self.args.head_dim, self.kv_dtype
            ),
            **{f"total_{k}": v for k, v in self._totals.items()},
        }

    def _spec_stats(self) -> dict[str, Any]:
        if self.drafter is None:
            return {}
        t = self._spec_totals
        return {
            "spec_algorithm": self.config.speculative_algorithm,
            "spec_verify_steps": t["steps"],
            "spec_proposed_tokens": t["proposed"],
            "spec_accepted_tokens": t["accepted"],
            "spec_acceptance_rate": t["accepted"] / t["proposed"] if t["proposed"] else 0.0,
            "spec_mean_accept_length": (t["accepted"] + t["steps"]) / t["steps"] if t["steps"] else 0.0,
        }

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are running or waiting."""
        done = threading.Event()
        outcome: list[bool] = []
        self._post("flush", (done, outcome))
        done.wait()
        return outcome[0]

    def shutdown(self) -> None:
        if self._grammars is not None:
            self._grammars.shutdown(wait=False)
        if not self._stopped.is_set():
            self._post("stop", None)
            self._thread.join(timeout=10)
            self._stopped.set()
            if self.tp is not None:
                self.tp.shutdown()
        if not self._thread.is_alive():  # what raced in after the loop's own drain
            lifecycle.drain(self, self._inbox)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _compile_timeout(req: Request, limit: float) -> ValueError:
    from plait.runtime.constrained import GrammarError

    p = req.params
    name = "regex" if p.regex is not None else "ebnf" if p.ebnf is not None else "json_schema"
    return GrammarError(
        f"{name}: compiling the constraint took longer than {limit:g} s; simplify it"
    )


def _healing(req: Request) -> bool:
    """Whether the output has yet to cover the text token healing backed up over, and what the
    grammar forces does not reach past it (then the jump retokenizes across the boundary, which
    is what healing is for)."""
    if not req.healed_text or len(req.text) >= len(req.healed_text):
        return False
    forced = req.grammar.try_jump_forward() if req.grammar is not None else None
    return forced is None or len(req.text) + len(forced) <= len(req.healed_text)


def off_main_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs `fn(*args)` on a short-lived thread and returns its result (or raises its error).

    NOTE: libgomp throttles its spin-wait to ~100 iterations once it manages more threads than
    there are CPUs, and the main thread's OpenMP team counts even while it sleeps. Loading a model
    runs parallel torch ops; on the main thread that would leave a team behind and make every
    parallel op of the engine thread pay a futex wake-up (4x slower for a 200k-element add on 2
    cores). A helper thread's team is freed when the thread exits.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="plait-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _indexed_sink(
    put: Callable[[tuple[int, dict, bool]], None], index: int, stream_all: bool = True
) -> Callable[[dict, bool], None]:
    def deliver(out: dict, final: bool) -> None:
        if final or stream_all:
            put((index, out, final))

    return deliver
