"""The only code that turns scheduling state into tensors: builds a step's ragged batch and runs the
model over it, or runs its decode burst (`decode_burst.py`); the logits become each request's
tokens and logprobs in `step_tokens.py`."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from plait.radix_cache import WindowPages
from plait.runtime.batch import (
    ExtendEntry,
    RequestResult,
    ScheduleBatch,
    StepResults,
    TokenResult,
    VerifyEntry,
)
from plait.runtime.decode_burst import BurstRunner
from plait.runtime.execution import Layers, choose_execution
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.kv_pool import KVPool
from plait.runtime.models.llama import LlamaForCausalLM
from plait.runtime.page_tables import PageRows, PageTables
from plait.runtime.request import Request
from plait.runtime.step_tokens import StepTokens

if TYPE_CHECKING:
    from plait.runtime.burst_streams import BurstStreams
    from plait.runtime.step_planner import StepPlan

# (the burst's streaming rows as (row, request), its tokens [B, steps]) -> their streams
StreamsFactory = Callable[[list[tuple[int, Request]], np.ndarray], "BurstStreams"]


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    forward_batch: ForwardBatch
    plans: list[tuple[list[int], bool]]  # per entry: input-logprob rows, samples a token
    layers: Layers


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_pool: KVPool,
        device: torch.device,
        eos_ids: frozenset[int],
        default_generator: torch.Generator,
        jump_forward: bool = True,
        window: WindowPages | None = None,
        deterministic: bool = False,
        page_rows: PageRows | None = None,
    ) -> None:
        """`page_rows`: the page-table buffers of another runner over the same pages (a draft
        model's runner shares the target's)."""
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.page_size = kv_pool.page_size
        # the model-wide choices, once
        self.execution = choose_execution(model, kv_pool, device, deterministic)
        self.tables = PageTables(
            self.page_size,
            device,
            window if kv_pool.has_window_layers else None,
            page_rows,
            attention=self.execution.attention,
        )
        # the layouts a step builds, as (in window pages, the window of their CPU rows): the
        # pool's pages, and the window pages where some layers slide; one alone where all do
        uniform = self.execution.sliding_window
        if not kv_pool.has_window_layers:
            self._spaces = [(False, uniform)]
        elif all(kv_pool.window_layers):
            self._spaces = [(True, uniform)]
        else:
            self._spaces = [(False, None), (True, model.args.sliding_window)]
        self.bursts = BurstRunner(
            model,
            self.execution,
            self.tables,
            self._spaces,
            eos_ids,
            default_generator,
            jump_forward,
        )
        self.tokens = StepTokens(
            device, model.args.vocab_size, eos_ids, default_generator, self.execution.sampling
        )

    @property
    def bf16_extends(self) -> bool:
        """Quantized weights on a CPU whose GEMM has AMX: prefill chunks attend in bfloat16 as well
        as multiply in it (kernels/quant_matmul.py: bf16_matmul); float32 models stay float32."""
        return self.execution.bf16_extends

    def prepare(self, batch: ScheduleBatch, layers: Layers | None = None) -> PreparedBatch:
        """Builds the step's tensors from the batch's Python state; the layers as the step's plan
        says (`StepPlanner`), or by the batch's shape where no plan is given (drafting)."""
        ids: list[int] = []
        positions: list[int] = []
        extends: list[tuple[Request, int, int, int]] = []
        logit_rows: list[int] = []
        plans: list[tuple[list[int], bool]] = []
        for e in batch.queried:
            req, draft = e.req, e.draft_ids
            row0 = len(ids)
            end = e.end + len(draft)
            ids.extend(req.ids_between(e.start, e.end))
            ids.extend(draft)
            positions.extend(range(e.start, end))
            extends.append((req, e.start, end, row0))
            input_rows = self._input_logprob_rows(e)
            logit_rows.extend(row0 + r - e.start for r in input_rows)
            samples = e.is_last_chunk and req.budget_left > 0
            if samples:  # the last real token, then one row per draft token
                logit_rows.extend(row0 + e.end - 1 - e.start + j for j in range(len(draft) + 1))
            plans.append((input_rows, samples))
        for r in batch.decodes:
            logit_rows.append(len(ids))
            ids.append(r.last_id)
            positions.append(r.num_tokens - 1)
            plans.append(([], True))
        spaces = self._spaces  # (in window pages, the window its CPU rows are built for)
        metas = [
            self.tables.layout(
                extends,
                batch.decodes,
                window=window,
                rows_window=rows_window,
                num_kv_heads=self.model.args.num_kv_heads,
                bf16_extends=self.execution.bf16_extends,
                batch_invariant=self.execution.batch_invariant,
            )
            for window, rows_window in spaces
        ]
        if layers is None:
            layers = self.execution.layers_for(len(ids), max(metas[0].extend_q_lens, default=0))
        forward_batch = ForwardBatch(
            kv_pool=self.kv_pool,
            attn=metas[0],
            logits_indices=torch.tensor(logit_rows, dtype=torch.long, device=self.device),
            ops=self.execution.ops,
            native_stack=self.execution.native_stack if layers is Layers.NATIVE_STACK else None,
            attn_window=metas[1] if len(metas) > 1 else None,
            batch_invariant=self.execution.batch_invariant,
        )
        return PreparedBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            forward_batch=forward_batch,
            plans=plans,
            layers=layers,
        )

    def execute(
        self,
        plan: StepPlan,
        interrupt: ctypes.c_int32 | None = None,
        streams: StreamsFactory | None = None,
    ) -> StepResults:
        """Runs a step as planned: one forward pass with the plan's layers, or its burst of
        decode steps (`BurstRunner.run`; `interrupt` ends it after a step, and `streams` hands its
        streaming rows their tokens between steps). Each result carries its request."""
        batch = plan.batch
        started = time.perf_counter()
        streamed = {}
        if plan.burst:
            rows = [(i, r) for i, r in enumerate(batch.decodes) if r.delivery.streaming]
            if rows and streams is not None:
                out = torch.full((len(batch.decodes), plan.decode_steps), -1, dtype=torch.long)
                hook = streams(rows, out.numpy())  # out: [B, steps]
                tokens = self.bursts.run(
                    batch, plan.decode_steps, interrupt, out=out, between_steps=hook.before_step
                )
                streamed = hook.streamed
            else:
                tokens = self.bursts.run(batch, plan.decode_steps, interrupt)
            steps = max(len(t.tokens) for t in tokens)
        else:
            tokens = self.forward(batch, plan.layers)
            steps = 1
        step_s = (time.perf_counter() - started) / steps
        got = iter(tokens)  # in the forward's order, `batch.requests()`
        results = [RequestResult(e.req, next(got), extend=e) for e in batch.extends]
        results += [RequestResult(v.req, next(got), verify=v) for v in batch.verifies]
        results += [RequestResult(r, next(got), streamed=streamed.get(r)) for r in batch.decodes]
        return StepResults(results, steps, step_s)

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch, layers: Layers | None = None) -> list[TokenResult]:
        """Runs one step; results align with `batch.requests()`."""
        prepared = self.prepare(batch, layers)
        masks = self.tokens.start_masks(batch, prepared.plans)
        # [num_logit_rows, vocab]
        logits = self.model(prepared.input_ids, prepared.positions, prepared.forward_batch)
        return self.tokens.results(batch, prepared.plans, logits, masks)

    @torch.inference_mode()
    def last_logits(self, batch: ScheduleBatch, num_layers: int | None = None) -> torch.Tensor:
        """Logits [num_extends, vocab] of each extend entry's last token, nothing sampled
        (drafting). A verification entry's `draft_ids` are part of its input."""
        prepared = self.prepare(batch)
        meta = prepared.forward_batch.attn
        last = [s + n - 1 for s, n in zip(meta.extend_q_starts, meta.extend_q_lens)]
        prepared.forward_batch.logits_indices = torch.tensor(
            last, dtype=torch.long, device=self.device
        )
        return self.model(
            prepared.input_ids, prepared.positions, prepared.forward_batch, num_layers
        )

    def _input_logprob_rows(self, e: ExtendEntry | VerifyEntry) -> list[int]:
        """Positions r in [start, end) whose logits score prompt token r + 1 for input logprobs."""
        req = e.req
        if not req.sampling.logprob.return_logprob:
            return []
        prompt_len = len(req.prompt_ids)
        done = max(len(req.input_token_logprobs) - 1, 0)
        first = max(e.start, req.logprob_start + done)
        return list(range(first, min(e.end, prompt_len - 1)))
