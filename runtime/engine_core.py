"""`EngineCore`: what the engine loop owns and runs: the model, its KV pool, the scheduler and the
runner; the loop's inbox, each `step`, and the delivery of results to each request's sink.

The loop thread holds this object, never the `Engine` in front of it, so an `Engine` that is
dropped can be collected: its finalizer stops the loop (`shutdown`), and the loop's last act is to
let go of the model, the KV pool and the runner."""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
import traceback
from typing import Any

import torch

from plait.kernels.kv_cache import resolve_kv_dtype
from plait.radix_cache import PageAllocator, RadixCache, WindowPages
from plait.runtime import constraint_tools, lifecycle
from plait.runtime.batch import ScheduleBatch, TokenResult
from plait.runtime.budget_closing import BudgetClosing
from plait.runtime.burst_streams import StreamedTokens
from plait.runtime.bursts import Bursts
from plait.runtime.closing_jobs import ClosingJobs
from plait.runtime.config import EngineConfig
from plait.runtime.engine_setup import (
    num_kv_pages,
    off_main_thread,
    resolve_device,
    resolve_dtype,
    window_layers,
)
from plait.runtime.events import BatchScheduled, EngineEvents, RequestFinished, StepFinished
from plait.runtime.kv_pool import KVPool
from plait.runtime.model_loader import load_model
from plait.runtime.model_runner import ModelRunner
from plait.runtime.models.quantized import quantized_linears, weight_bytes
from plait.runtime.output_processor import OutputProcessor
from plait.runtime.outputs import build_output
from plait.runtime.policies import ThreadPolicy
from plait.runtime.protocol import FinishReason
from plait.runtime.request import Request
from plait.runtime.scheduler import Scheduler
from plait.runtime.speculation import Speculation
from plait.runtime.tuning import CLOSING_GROWTH, CLOSING_WAIT_SECONDS

logger = logging.getLogger("plait.engine")


class EngineCore:
    """Built from a validated `EngineConfig`; starts the loop thread (`plait-engine`) at once.
    Other threads talk to the loop only through `post` (an inbox message) and the sinks of the
    requests they submit; `shutdown` stops it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = self.config.model
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        quantization = mc.quantization
        if quantization is None and self.config.tp_size > 1:  # the shards are float
            quantization = "float32"
        loaded = off_main_thread(load_model, mc.model_path, self.dtype, self.device, quantization)
        self.model, self.args, self.tokenizer = loaded.model, loaded.args, loaded.tokenizer
        self.family, self.weight_types = loaded.family.name, loaded.weight_types
        self.tp: Any = None
        if self.config.tp_size > 1 and not loaded.family.tensor_parallel:
            raise ValueError(f"tp_size: the {self.family} family runs on one device (tp_size=1)")
        if self.config.tp_size > 1:
            from plait.runtime.tensor_parallel import start_tensor_parallel

            self.tp = start_tensor_parallel(self.model, self.config, self.device)
            self.model, self.args = self.tp.model, self.tp.args  # args: this rank's heads
        self.model_path = loaded.location.path
        self.context_len = mc.context_length or self.args.max_position_embeddings
        self.weight_bytes = weight_bytes(self.model)  # read by one decode step: the roofline
        cc = self.config.cache
        self.page_size = cc.page_size
        self.kv_dtype = resolve_kv_dtype(
            cc.kv_cache_dtype, self.dtype, self.device, quantized_linears(self.model)
        )
        sc = self.config.scheduler
        num_pages, num_window_pages = num_kv_pages(
            cc, sc, self.args, self.kv_dtype, self.device, self.context_len
        )
        self.kv_pool = KVPool(
            num_pages,
            cc.page_size,
            self.args.num_layers,
            self.args.num_kv_heads,
            self.args.head_dim,
            self.kv_dtype,
            self.device,
            window_layers(self.args),
            num_window_pages,
        )
        if self.tp is not None:
            self.tp.start_workers(num_pages, cc.page_size, num_window_pages)
        self.allocator = PageAllocator(num_pages)
        self.window = None
        if num_window_pages:  # the sliding layers' pages (runtime/kv_pool.py)
            self.window = WindowPages(
                num_pages, num_window_pages, self.args.sliding_window, cc.page_size
            )
            self.allocator.on_free = self.window.logical_freed
        self.tiers: Any = None  # KVTiers: local disk and Redis below the pool
        self.handoff: Any = None  # KVHandoff: prefill–decode disaggregation, built on first use
        self._handoff_lock = threading.Lock()
        self.salt: bytes | None = None
        if cc.kv_tiers:
            if self.window is not None:
                raise ValueError(
                    "kv_disk/kv_redis: the KV tiers store whole-model pages; a model with "
                    "sliding-window layers keeps those layers' KV in window pages, which the tiers "
                    "do not hold yet"
                )
            from plait.runtime.kv_tiers import engine_salt

            self.salt = engine_salt(self)
        salt = self.salt
        self.cache = RadixCache(
            cc.page_size, self.allocator, disable=cc.disable_radix_cache, salt=salt
        )
        self.events = EngineEvents()  # what observers subscribe to (`Engine.events`)
        self.events.watch_cache(self.cache)
        if salt is not None:
            from plait.runtime.kv_tiers import create_kv_tiers

            self.tiers = create_kv_tiers(cc, self.kv_pool, self.cache, salt)
        self.scheduler = Scheduler(
            sc, self.allocator, self.cache, cc.page_size, self.context_len, self.window,
            tiers=self.tiers, events=self.events,
        )  # fmt: skip
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.random_seed)
        self.runner = ModelRunner(
            self.model,
            self.kv_pool,
            self.device,
            self.tokenizer.eos_token_ids,
            self.generator,
            jump_forward=not self.config.disable_jump_forward,
            window=self.window,
        )
        # described once: the execution holds the weights, which shutdown lets go with the runner
        self.execution_stats = {
            f"execution_{k}": v for k, v in self.runner.execution.describe().items()
        }
        self.processor = OutputProcessor(self.tokenizer, self.context_len)
        self.speculation = Speculation(config, self)
        self.threads = ThreadPolicy(self.device, config.cpu_threads)
        # the grammar backend and compile cache, closing search and healer, built meanwhile
        self.constraint_tools = constraint_tools.start(self.tokenizer, config, self.args.vocab_size)
        drafts = config.num_draft_tokens if self.speculation.drafter is not None else 0
        # what one step may add to a constrained request, plus a margin for what it may open
        self.closing = BudgetClosing(
            self.closing_search, ClosingJobs(), self.tokenizer, self.context_len,
            slack=1 + drafts + CLOSING_GROWTH, plan_jump=self._plan_jump,
        )  # fmt: skip
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        # set by `post` from any thread: a running decode burst ends after its current step
        self._interrupt = ctypes.c_int32(0)
        self.bursts = Bursts(
            config.scheduler.num_continuous_decode_steps,
            self.processor,
            self.deliver,
            self._interrupt,
        )
        self._stopped = threading.Event()
        self._totals = {
            "requests": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "steps": 0,
            "burst_steps": 0,
        }
        self._thread = threading.Thread(target=self._loop, name="plait-engine", daemon=True)
        self._thread.start()

    @property
    def drafter(self) -> Any:
        return self.speculation.drafter

    @property
    def governor(self) -> Any:
        return self.speculation.governor

    @property
    def thread_governor(self) -> Any:
        return self.threads.governor

    def closing_search(self) -> Any:
        return self.constraint_tools.result().closing

    def kv_handoff(self) -> Any:
        """The `KVHandoff` that exports and imports prompts' KV (built on first use; any thread)."""
        with self._handoff_lock:
            if self.handoff is None:
                from plait.runtime.kv_tiers import engine_salt
                from plait.runtime.kv_tiers.handoff import KVHandoff

                if self.tp is not None or self.cache.disable:
                    raise ValueError(
                        "kv handoff: needs the radix cache and one device (not disable_radix_cache "
                        "or tp_size > 1)"
                    )
                if self.window is not None:
                    raise ValueError(
                        "kv handoff: a model with sliding-window layers keeps those layers' KV in "
                        "window pages, which the handoff does not carry yet"
                    )
                self.salt = self.salt or engine_salt(self)
                self.handoff = KVHandoff(self.kv_pool, self.cache, self.salt)
            return self.handoff

    def call(self, fn: Any) -> Any:
        """Runs `fn()` on the loop between steps; a concurrent Future of its result."""
        from concurrent.futures import Future

        if self.stopped:
            raise RuntimeError("Engine: already shut down")
        future: Future = Future()
        self.post("call", (fn, future))
        return future

    # the loop --------------------------------------------------------------------------------

    def post(self, kind: str, item: Any) -> None:
        """Hands the loop a message (`add`, `abort`, `flush`, `call`, `stop`); ends a running
        burst."""
        self._inbox.put((kind, item))
        self._interrupt.value = 1

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def _loop(self) -> None:
        try:
            self.threads.start()
            self._run_loop()
        finally:
            self.threads.release()  # the thread count is the process's: give it back
            self._release()

    def _release(self) -> None:
        """After the loop's last step: lets go of the weights, the KV pool and what holds them
        (tensor parallelism's workers, if any, are stopped by `shutdown`)."""
        self.closing.jobs.close()
        if self.tiers is not None:
            self.tiers.close()  # stores what is still queued for the tiers below the pool
        self.model = self.kv_pool = self.runner = None  # type: ignore[assignment]
        self.speculation.drafter = None

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
                    if self.handoff is not None:  # pages imported for it stay until it is admitted
                        self.handoff.claim(req)
                except Exception as exc:
                    status = 400 if isinstance(exc, ValueError) else 500
                    self.processor.finish(
                        req, FinishReason("abort", message=str(exc), status_code=status)
                    )
                    self.deliver(req)
        elif kind == "abort":
            req = self.scheduler.abort(item)
            if req is not None and not req.finished:
                self.processor.finish(req, FinishReason("abort", message="aborted by the client"))
                self.deliver(req)
        elif kind == "flush":
            done, outcome = item
            ok = not self.scheduler.has_work()
            if ok:
                if self.handoff is not None:
                    self.handoff.release_all()
                self.cache.reset()
            outcome.append(ok)
            done.set()
        elif kind == "call":
            fn, future = item
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
        elif kind == "stop":
            self._stopped.set()

    def step(self) -> None:
        """One forward pass over the scheduler's next batch, then bookkeeping and delivery."""
        held = [r for r in self.scheduler.running if r.closing_job is not None]
        if held:
            self._take_closings(held)
        batch = self.scheduler.schedule()
        started = time.perf_counter()
        plain_decode = not batch.extends  # a step the speculation governor can learn from
        speculating = self.speculation.speculate(batch)
        if speculating:
            self.speculation.propose(batch, self.scheduler, self.context_len)
        if not batch:
            ClosingJobs.wait(self.scheduler.running, timeout=CLOSING_WAIT_SECONDS)
            if self.tiers is not None:  # requests waiting for their blocks from below the pool
                self.tiers.wait(CLOSING_WAIT_SECONDS)
            return
        if self.events.wants(BatchScheduled):
            self.events.batch_scheduled(batch)
        num_tokens = batch.num_tokens
        threads = self.threads.choose(num_tokens)
        forward_started = time.perf_counter()
        streamed: dict[int, StreamedTokens] = {}  # by id(request): tokens handed on mid-burst
        try:
            burst = self.bursts.steps(
                batch, self.runner, self.scheduler,
                idle=self._inbox.empty(), speculating=speculating, closing=self.closing,
            )  # fmt: skip
            if burst > 1:
                results, streamed = self.bursts.run(batch, self.runner, burst)
                batch.decode_steps = max(len(r.tokens) for r in results)
                self._totals["burst_steps"] += batch.decode_steps
            else:
                results = self.runner.forward(batch)
        except Exception as exc:  # a failing batch must not take the engine down
            logger.error("forward pass failed: %s", traceback.format_exc())
            reqs = batch.requests()
            if len({id(r) for r in reqs}) > 1:
                self.scheduler.quarantine(reqs)  # retried one by one: only the culprit fails
            else:
                self._fail(batch, f"internal error: {type(exc).__name__}: {exc}")
            return
        step_s = (time.perf_counter() - forward_started) / batch.decode_steps
        if self.tiers is not None and batch.extends:
            self.tiers.record_prefill(sum(e.end - e.start for e in batch.extends), step_s)
        self.bursts.record(batch, step_s)
        self.threads.record(num_tokens, threads, step_s)
        self._totals["steps"] += batch.decode_steps
        entries = batch.requests()
        last_chunk = [e.is_last_chunk for e in batch.queried] + [True] * len(batch.decodes)
        updated: list[Request] = []
        if self.drafter is not None and plain_decode and entries:
            # verifying drafts against bursts: a step the drafter found nothing for counts as a
            # plain one (a short burst), whoever chose it
            verified = bool(batch.verifies)
            tokens = sum(len(r.tokens) for r in results)
            self.speculation.policy.record(
                len(entries),
                verified,
                tokens,
                time.perf_counter() - started,
                steps=batch.decode_steps,
            )
        for entry, req, result, done_prompt in zip(
            [*[None] * len(batch.extends), *batch.verifies, *[None] * len(batch.decodes)],
            entries,
            results,
            last_chunk,
        ):
            got = streamed.get(id(req))
            if got is not None and got.taken:  # its first `taken` tokens are appended already
                self._totals["generated_tokens"] += got.added
                if req.finished or len(result.tokens) == got.taken:
                    if req.finished:  # by the streamer: delivered below, as final results are
                        updated.append(req)
                    continue
                result = TokenResult(tokens=result.tokens[got.taken :])
            if req.finished:
                continue
            self.processor.record_input_logprobs(req, result)
            if result.tokens:
                if req.first_token_time is None:
                    req.first_token_time = time.perf_counter()
                if req.closing_path is not None:
                    # an extend caches the request's whole pages after the step (`after_step`)
                    result = self.closing.steer(
                        req, result, prefilled=req in self.scheduler.prefilling
                    )
                added = self.processor.append_tokens(req, result)
                self._totals["generated_tokens"] += added
                if entry is not None:  # a verification
                    entry.num_accepted = min(len(result.tokens) - 1, added)
                    self.speculation.observe(req, len(entry.draft_ids), len(result.tokens) - 1)
                updated.append(req)
            elif done_prompt:
                self.processor.finish(req, FinishReason("length", length=req.num_output_tokens))
                updated.append(req)
        # NOTE: pages are released before results are delivered, so a caller that got its
        # result sees the pool without that request.
        self.scheduler.after_step(batch)
        for req in updated:
            self._close_or_jump(req)
        if self.config.check_invariants:
            self.scheduler.check()
        if self.events.wants(StepFinished):
            self.events.step_finished(batch, started)
        for req in updated:
            self.deliver(req)

    def _close_or_jump(self, req: Request) -> None:
        """After a step: a constrained request near its budget steers toward its closing
        (`BudgetClosing.check`); others jump over the text their grammar forces."""
        if req.grammar is None or req.finished or req not in self.scheduler.running:
            return
        self.closing.check(req)
        # NOTE: not over the healed text alone: that would re-append the very token healing
        # backed up over, instead of letting the model choose the merged one; nor while a closing
        # is looked for off the loop: the search is of this state, and the request waits for it
        if not self.config.disable_jump_forward and not _healing(req) and req.closing_job is None:
            self._jump_forward(req)

    def _take_closings(self, held: list[Request]) -> None:
        """Requests whose off-loop closing search is done go back to decoding, steering where
        their room is down to the closing found."""
        for req in ClosingJobs.done(held):
            self.closing.job_done(req)

    def _plan_jump(self, req: Request, output_ids: list[int], grammar: Any, prefilled: bool) -> Any:
        """The jump over forced text after `output_ids` that `_close_or_jump` would take after
        this step (`prefilled`: the step extends `req`, so its whole pages will be cached)."""
        if self.config.disable_jump_forward or _healing(req):
            return None
        cached = req.num_cached_pages * self.page_size
        if prefilled:
            cached = max(cached, req.num_tokens // self.page_size * self.page_size)
        return self.processor.plan_jump(req, output_ids, grammar, cached)

    def _jump_forward(self, req: Request) -> None:
        before = req.num_tokens
        replaced = self.processor.try_jump_forward(
            req,
            min_kept_tokens=req.num_cached_pages * self.page_size,
            closing=self.closing.after_jump,
        )
        if replaced is not None:
            self.scheduler.rewind(req, num_valid=before - replaced)

    def _fail(self, batch: ScheduleBatch, message: str) -> None:
        for req in batch.requests():
            self.scheduler.abort(req.rid, keep=False)  # its KV may be half written
            if not req.finished:
                self.processor.finish(req, FinishReason("abort", message=message, status_code=500))
                self.deliver(req)

    def deliver(self, req: Request) -> None:
        if req.finished and self.events.wants(RequestFinished):
            self.events.request_finished(req)
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
            "cache_hit_rate": sched.cached_prompt_tokens / sched.prompt_tokens
            if sched.prompt_tokens
            else 0.0,
            "num_retracted": sched.num_retracted,
            "total_computed_tokens": sched.computed_tokens,
            **self.speculation.stats(),
            "new_token_ratio": sched.new_token_ratio,
            "quantization": self.config.model.quantization,
            "model_family": self.family,
            "weight_types": self.weight_types,
            "cpu_threads": self.threads.current if self.device.type == "cpu" else None,
            "weight_bytes": self.weight_bytes,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": KVPool.bytes_per_token(
                self.args.num_layers, self.args.num_kv_heads, self.args.head_dim, self.kv_dtype
            ),
            **self._window_stats(total - free),
            **self.execution_stats,
            **(self.tiers.stats() if self.tiers is not None else {}),
            **(self.handoff.stats() if self.handoff is not None else {}),
            **{f"total_{k}": v for k, v in self._totals.items()},
        }

    def _window_stats(self, pages_held: int) -> dict[str, int]:
        """The sliding layers' pages, and the bytes of KV held now (requests and cache, every
        layer): each held page in the full layers, each held window page in the sliding ones."""
        window, args = self.window, self.args
        per_page = self.page_size * KVPool.bytes_per_token(
            1, args.num_kv_heads, args.head_dim, self.kv_dtype
        )
        sliding = window_layers(args).count(True) if window is not None else 0
        held = pages_held * per_page * (args.num_layers - sliding)
        if window is None:
            return {"kv_bytes_held": held}
        return {
            "kv_window_pages_total": window.num_pages,
            "kv_window_pages_free": window.allocator.num_free,
            "kv_window_pages_evictable": window.available() - window.allocator.num_free,
            "kv_bytes_held": held + window.num_attached * per_page * sliding,
        }

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are running or waiting."""
        done = threading.Event()
        outcome: list[bool] = []
        self.post("flush", (done, outcome))
        done.wait()
        return outcome[0]

    def shutdown(self) -> None:
        """Stops the loop: queued and running requests end as aborted (503), the thread exits and
        the model and KV pool are let go. Idempotent; callable from any thread, the loop's own
        included (a finalizer may run there), which then does not wait for itself."""
        tools = self.constraint_tools
        if tools.done() and tools.exception() is None:
            tools.result().grammars.shutdown(wait=False)
        if not self._stopped.is_set():
            self.post("stop", None)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=10)
            self._stopped.set()
            if self.tp is not None:
                self.tp.shutdown()
                self.tp = None
        if not self._thread.is_alive():  # what raced in after the loop's own drain
            lifecycle.drain(self, self._inbox)


def _healing(req: Request) -> bool:
    """Whether the output has yet to cover the text token healing backed up over, and what the
    grammar forces does not reach past it (then the jump retokenizes across the boundary, which
    is what healing is for)."""
    if not req.healed_text or len(req.text) >= len(req.healed_text):
        return False
    forced = req.grammar.try_jump_forward() if req.grammar is not None else None
    return forced is None or len(req.text) + len(forced) <= len(req.healed_text)
