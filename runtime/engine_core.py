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
import traceback
from typing import Any

import torch

from plait.kernels.kv_cache import resolve_kv_dtype
from plait.kernels.openmp import release_thread_team
from plait.radix_cache import PageAllocator, RadixCache, WindowPages
from plait.runtime import constraint_tools, lifecycle
from plait.runtime.batch import ScheduleBatch, StepResults
from plait.runtime.budget_closing import BudgetClosing
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
from plait.runtime.engine_stats import engine_stats
from plait.runtime.events import BatchScheduled, EngineEvents
from plait.runtime.kv_pool import KVPool
from plait.runtime.model_loader import load_model
from plait.runtime.model_runner import ModelRunner
from plait.runtime.models.quantized import quantized_linears, weight_bytes
from plait.runtime.output_processor import OutputProcessor
from plait.runtime.policies import ThreadPolicy
from plait.runtime.request import Request
from plait.runtime.scheduler import Scheduler
from plait.runtime.speculation import Speculation
from plait.runtime.speculative.base import DraftContext
from plait.runtime.step_applier import StepApplier
from plait.runtime.step_planner import StepPlan, StepPlanner
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
            sc,
            self.allocator,
            self.cache,
            cc.page_size,
            self.context_len,
            self.window,
            tiers=self.tiers,
            events=self.events,
        )
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.random_seed)
        self.runner = ModelRunner(
            self.model,
            self.kv_pool,
            self.device,
            self.tokenizer.eos_token_ids,
            self.generator,
            jump_forward=not self.config.disable_jump_forward,
            window=self.window,
            deterministic=self.config.deterministic,
        )
        # described once: the execution holds the weights, which shutdown lets go with the runner
        self.execution_stats = {
            f"execution_{k}": v for k, v in self.runner.execution.describe().items()
        }
        self.processor = OutputProcessor(self.tokenizer, self.context_len)
        draft_context = DraftContext(
            config,
            self.args,
            self.runner,
            self.scheduler.kv,
            self.kv_pool.num_pages,
            self.page_size,
            self.dtype,
            self.device,
            self.tokenizer.eos_token_ids,
            self.generator,
        )
        self.speculation = Speculation(config, draft_context)
        self.threads = ThreadPolicy(self.device, config.cpu_threads)
        # the grammar backend and compile cache, closing search and healer, built meanwhile
        self.constraint_tools = constraint_tools.start(self.tokenizer, config, self.args.vocab_size)
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        # set by `post` from any thread: a running decode burst ends after its current step
        self._interrupt = ctypes.c_int32(0)
        self._stopped = threading.Event()
        # counted by the loop and the applier since start (`stats()`: total_*)
        self.totals = {
            "requests": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "steps": 0,
            "burst_steps": 0,
        }
        # an engine step in four stages: the scheduler's batch, the planner's plan, the runner's
        # results, the applier's appending, jumps and delivery (`step`)
        self.applier = StepApplier(
            processor=self.processor,
            tokenizer=self.tokenizer,
            kv=self.scheduler.kv,
            speculation=self.speculation,
            page_size=self.page_size,
            jump_forward=not self.config.disable_jump_forward,
            totals=self.totals,
            events=self.events,
        )
        drafts = config.num_draft_tokens if self.speculation.drafter is not None else 0
        # what one step may add to a constrained request, plus a margin for what it may open
        self.closing = BudgetClosing(
            self.closing_search,
            ClosingJobs(),
            self.tokenizer,
            self.context_len,
            slack=1 + drafts + CLOSING_GROWTH,
            plan_jump=self.applier.plan_jump,
        )
        self.applier.closing = self.closing
        self.bursts = Bursts(config.scheduler.num_continuous_decode_steps)
        self.planner = StepPlanner(
            kv=self.scheduler.kv,
            execution=self.runner.execution,
            can_burst=self.runner.bursts.can_run,
            speculation=self.speculation,
            threads=self.threads,
            bursts=self.bursts,
            closing=self.closing,
            context_len=self.context_len,
            tiers=self.tiers,
        )
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
        self.planner = None  # type: ignore[assignment]  # it asks the runner what can burst
        self.speculation.drafter = None

    def _run_loop(self) -> None:
        while not self._stopped.is_set():
            block = not self.scheduler.has_work()
            if block:
                # idle: its OpenMP team's workers exit, or libgomp would count them against the
                # CPUs and throttle the teams of every other engine in the process
                # (kernels/openmp.py); the next step starts a team again
                release_thread_team()
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
        if kind == "stop":
            self._stopped.set()
        else:
            lifecycle.handle(self, kind, item)

    def step(self) -> None:
        """One engine step in four stages: the scheduler makes the batch, the planner decides how
        to run it, the runner runs it, the applier takes the results."""
        batch = self._schedule()
        if batch is None:
            return
        plan = self.planner.plan(batch, idle=self._inbox.empty())
        results = self._execute(plan)
        if results is not None:
            self._apply(plan, results)

    def _schedule(self) -> ScheduleBatch | None:
        """The step's batch, once requests whose off-loop closing search is done are back; None
        when nothing can run now (then it waits briefly for closings and for blocks coming up
        from the tiers below the pool)."""
        self.applier.take_closings(self.scheduler.running)
        batch = self.scheduler.schedule()
        if batch:
            return batch
        ClosingJobs.wait(self.scheduler.running, timeout=CLOSING_WAIT_SECONDS)
        if self.tiers is not None:
            self.tiers.wait(CLOSING_WAIT_SECONDS)
        return None

    def _execute(self, plan: StepPlan) -> StepResults | None:
        """The runner's results for `plan`; None when the forward pass failed (its requests are
        then retried one by one or failed, `_forward_failed`)."""
        if self.events.wants(BatchScheduled):
            self.events.batch_scheduled(plan.batch)
        try:
            return self.runner.execute(plan, self._interrupt, self.applier.burst_streams)
        except Exception as exc:  # a failing batch must not take the engine down
            logger.error("forward pass failed: %s", traceback.format_exc())
            self._forward_failed(plan.batch, exc)
            return None

    def _apply(self, plan: StepPlan, results: StepResults) -> None:
        """The applier's stage: the step's time goes back to the planner's policies, the applier
        appends the tokens (`apply`), the scheduler records the step before anything is delivered
        (a caller that got its result sees the pool without that request), then the applier jumps,
        closes and delivers (`settle`)."""
        self.planner.record(plan, results)
        updated = self.applier.apply(plan, results)
        self.scheduler.after_step(plan.batch, results.decode_steps)
        self.applier.settle(plan, results, updated)
        if self.config.check_invariants:
            self.scheduler.check()

    def _forward_failed(self, batch: ScheduleBatch, exc: Exception) -> None:
        """A batch of several requests is retried one by one (only the culprit fails); a
        request alone fails, its KV dropped (it may be half written)."""
        reqs = batch.requests()
        if len(set(reqs)) > 1:
            self.scheduler.quarantine(reqs)
            return
        message = f"internal error: {type(exc).__name__}: {exc}"
        for req in reqs:
            lifecycle.end(self, req, message, 500, keep=False)

    def deliver(self, req: Request) -> None:
        self.applier.deliver(req)

    # introspection and shutdown ----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return engine_stats(self)

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are running or waiting."""
        done = threading.Event()
        outcome: list[bool] = []
        self.post("flush", (done, outcome))
        done.wait()
        return outcome[0]

    def on_loop_thread(self) -> bool:
        """Whether the caller is the engine's own loop thread."""
        return threading.current_thread() is self._thread

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
