"""The only code that turns scheduling state into tensors: builds a ragged batch, runs the model,
computes logprobs and samples."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from plait.kernels import sampling_cpu
from plait.kernels.constraint_mask import allocate_token_bitmask, apply_token_bitmask
from plait.kernels.decode_stack import MASK_FN, BurstMasks, BurstSampling
from plait.radix_cache import WindowPages
from plait.runtime.batch import (
    ExtendEntry,
    RequestResult,
    ScheduleBatch,
    StepResults,
    TokenResult,
    VerifyEntry,
)
from plait.runtime.constrained.burst_masks import GrammarBurst
from plait.runtime.execution import Layers, choose_execution
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.kv_pool import KVPool
from plait.runtime.models.llama import LlamaForCausalLM
from plait.runtime.page_tables import PageTables
from plait.runtime.request import Request
from plait.runtime.sampling import SamplingRow, argmax, filter_params, sample
from plait.runtime.speculative.verify import verify_draft
from plait.runtime.tuning import CLOSING_CANDIDATES

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
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.page_size = kv_pool.page_size
        self.eos_ids = eos_ids
        self.default_generator = default_generator
        self.jump_forward = jump_forward  # the engine jumps over forced text: bursts end there
        self._mask_pool: ThreadPoolExecutor | None = None  # fills grammar masks beside the forward
        # the model-wide choices, once
        self.execution = choose_execution(model, kv_pool, device, deterministic)
        self.tables = PageTables(
            self.page_size, device, window if kv_pool.has_window_layers else None
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
        for e, draft in zip(batch.queried, batch.drafts()):
            req = e.req
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
                attention=self.execution.attention,
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
        decode steps (`decode_burst`; `interrupt` ends it after a step, and `streams` hands its
        streaming rows their tokens between steps). Each result carries its request."""
        batch = plan.batch
        started = time.perf_counter()
        streamed = {}
        if plan.burst:
            rows = [(i, r) for i, r in enumerate(batch.decodes) if r.streaming]
            if rows and streams is not None:
                out = torch.full((len(batch.decodes), plan.decode_steps), -1, dtype=torch.long)
                hook = streams(rows, out.numpy())  # out: [B, steps]
                tokens = self.decode_burst(
                    batch, plan.decode_steps, interrupt, out=out, between_steps=hook.before_step
                )
                streamed = hook.streamed
            else:
                tokens = self.decode_burst(batch, plan.decode_steps, interrupt)
            batch.decode_steps = max(len(t.tokens) for t in tokens)
        else:
            tokens = self.forward(batch, plan.layers)
        step_s = (time.perf_counter() - started) / batch.decode_steps
        got = iter(tokens)  # in the forward's order, `batch.requests()`
        results = [RequestResult(e.req, next(got), extend=e) for e in batch.extends]
        results += [RequestResult(v.req, next(got), verify=v) for v in batch.verifies]
        results += [
            RequestResult(r, next(got), streamed=streamed.get(id(r))) for r in batch.decodes
        ]
        return StepResults(results, batch.decode_steps, step_s)

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch, layers: Layers | None = None) -> list[TokenResult]:
        """Runs one step; results align with `batch.requests()`."""
        prepared = self.prepare(batch, layers)
        masks = self._start_masks(batch, prepared.plans)
        logits = self.model(prepared.input_ids, prepared.positions, prepared.forward_batch)
        return self._results(
            batch, prepared.plans, logits, masks
        )  # logits: [num_logit_rows, vocab]

    def _start_masks(
        self, batch: ScheduleBatch, plans: list[tuple[list[int], bool]]
    ) -> Future[tuple[torch.Tensor, list[int]]] | None:
        """Fills the grammar masks of the step's sampled rows on another thread while the
        forward pass runs (the masks depend on the grammars' states only; llguidance releases
        the GIL). Rows in the order `_results` samples them: one-token entries, no drafts."""
        reqs, drafts = batch.requests(), batch.drafts()
        grammars = [
            r.grammar for r, (_, samples), d in zip(reqs, plans, drafts) if samples and not d
        ]
        if all(g is None for g in grammars):
            return None
        if self.device.type == "cpu" and torch.get_num_threads() >= _usable_cpus():
            # NOTE: every core runs the forward: a mask thread beside it preempts one of its
            # OpenMP threads, which the others then wait for at each barrier, and both run slower
            # than one after the other; filled after the forward instead (`_results`)
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-masks")
        vocab = self.model.args.vocab_size
        return self._mask_pool.submit(_fill_masks, grammars, vocab)

    def can_burst(self, batch: ScheduleBatch) -> bool:
        """Whether `decode_burst` can run this batch: decodes only, each one's next token a function
        of its raw logits and its grammar's mask (greedy, or sampled with no penalty), no
        logprobs, and a model whose whole step runs natively (the CPU kernels)."""
        if batch.queried or not self.execution.can_burst(len(batch.decodes)):
            return False
        if not all(_burst_logits(r) and not r.logprob.return_logprob for r in batch.decodes):
            return False
        return all(r.params.is_greedy for r in batch.decodes) or sampling_cpu.available()

    @torch.inference_mode()
    def decode_burst(
        self,
        batch: ScheduleBatch,
        steps: int,
        interrupt: ctypes.c_int32 | None = None,
        out: torch.Tensor | None = None,
        between_steps: Callable[[int], bool] | None = None,
    ) -> list[TokenResult]:
        """Up to `steps` decode steps of `batch.decodes` in one native call (see `can_burst`);
        each request's pages must cover `num_tokens + steps - 1` positions. A request's tokens may
        run past its stop token (when others in the batch go on): the output processor stops at it.
        `interrupt`: set non-zero by another thread, it ends the burst after a step. `out`
        (int64 [B, steps]), if given, receives each step's tokens as soon as they are picked.
        `between_steps(s)`, on this thread before each step s (the tokens of the steps before it
        are in `out`), ends the burst by returning True (`burst_streams.py`).
        Constrained rows pick among the tokens their grammar allows, masked between steps
        (`constrained/burst_masks.py`); the burst ends early where a grammar forces text (when
        `jump_forward`: jump-forward takes it from there) or every row has finished.

        A sampled request takes one uniform from its generator per step, as `sample` does step by
        step, so a seed gives the same tokens with or without bursts: its `steps` uniforms are
        drawn up front and, when the burst ends early, its generator is rewound to where the steps
        run leave it."""
        reqs = batch.decodes
        lens = [r.num_tokens for r in reqs]
        width = max(lens) + steps - 1
        # each row's slots in each page space a step lays out (`_spaces`)
        tables = [torch.zeros(len(reqs), width, dtype=torch.long) for _ in self._spaces]
        for i, r in enumerate(reqs):
            slots = self.tables.slots(r, 0, lens[i] + steps - 1)
            for table, (in_window, _) in zip(tables, self._spaces):
                table[i, : lens[i] + steps - 1] = (
                    self.tables.window_slots(slots) if in_window else slots
                )
        stop_ids = [
            sorted(set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else self.eos_ids))
            for r in reqs
        ]
        stack = self.execution.native_stack
        sampling, rewind = self._burst_sampling(reqs, steps)
        hooks = [] if between_steps is None else [between_steps]
        grammars = None
        if any(r.grammar is not None for r in reqs):
            if out is None:
                out = torch.full((len(reqs), steps), -1, dtype=torch.long)
            grammars = GrammarBurst(
                [r.grammar for r in reqs],
                stop_ids,
                out,
                self.model.args.vocab_size,
                self.jump_forward,
            )
            hooks.append(grammars.before_step)
        callback = _BetweenSteps(hooks, len(reqs), grammars) if hooks else None
        ran = 0
        try:
            tokens = stack.burst(
                self.model,
                torch.tensor([r.last_id for r in reqs], dtype=torch.long),
                tables,
                torch.tensor(lens, dtype=torch.long),
                steps,
                stop_ids,
                interrupt,
                sampling,
                out,
                callback.masks if callback is not None else None,
            )
            ran = tokens.shape[1]
            if callback is not None and callback.error is not None:
                raise callback.error
        finally:
            if ran < steps:  # one uniform per step run, as many as single steps would have taken
                for generator, state in rewind:
                    generator.set_state(state)
                    torch.rand(ran, generator=generator)
        return [TokenResult(tokens=row) for row in tokens.tolist()]

    def _burst_sampling(
        self, reqs: list[Request], steps: int
    ) -> tuple[BurstSampling | None, list[tuple[torch.Generator, torch.Tensor]]]:
        """A burst's sampling parameters and uniforms (None when every row is greedy), and the
        request generators to rewind, with their states before the draw."""
        if all(r.params.is_greedy for r in reqs):
            return None, []
        vocab = self.model.lm_head.out_features
        uniforms = torch.zeros(len(reqs), steps)
        rewind = []
        for i, r in enumerate(reqs):
            if r.params.is_greedy:
                continue
            if r.generator is not None:  # a seeded request's own; the shared default is not rewound
                rewind.append((r.generator, r.generator.get_state()))
            uniforms[i] = torch.rand(steps, generator=r.generator or self.default_generator)
        temperature, top_k, top_p, min_p = filter_params([r.params for r in reqs], vocab)
        return BurstSampling(temperature, top_k, top_p, min_p, uniforms), rewind

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
        if not req.logprob.return_logprob:
            return []
        prompt_len = len(req.prompt_ids)
        done = max(len(req.input_token_logprobs) - 1, 0)
        first = max(e.start, req.logprob_start + done)
        return list(range(first, min(e.end, prompt_len - 1)))

    def _results(
        self,
        batch: ScheduleBatch,
        plans: list[tuple[list[int], bool]],
        logits: torch.Tensor,
        masks: Future[tuple[torch.Tensor, list[int]]] | None = None,
    ) -> list[TokenResult]:
        reqs, drafts = batch.requests(), batch.drafts()
        results = [TokenResult() for _ in reqs]
        want_logprobs = any(r.logprob.return_logprob for r in reqs)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        sample_rows: list[int] = []  # one-token requests: their logits row
        sample_reqs: list[int] = []
        spec: list[tuple[int, int]] = []  # speculating requests: (request index, first row)
        cursor = 0
        for i, (req, (input_rows, samples)) in enumerate(zip(reqs, plans)):
            if input_rows:
                n = len(input_rows)
                context = req.ids_between(input_rows[0] + 1, input_rows[-1] + 2)  # rows ascend
                targets = torch.tensor(
                    [context[r - input_rows[0]] for r in input_rows],
                    dtype=torch.long,
                    device=logits.device,
                )
                lp = logprobs[cursor : cursor + n].gather(1, targets[:, None])[:, 0].tolist()
                results[i].input_logprobs = list(zip(lp, targets.tolist()))
                if req.logprob.top_logprobs_num:
                    results[i].input_top = _top(
                        logprobs[cursor : cursor + n], req.logprob.top_logprobs_num
                    )
                cursor += n
            if samples and drafts[i]:
                spec.append((i, cursor))
                cursor += len(drafts[i]) + 1
            elif samples:
                sample_rows.append(cursor)
                sample_reqs.append(i)
                cursor += 1
        if sample_rows and all(
            _plain_greedy(reqs[i]) for i in sample_reqs
        ):  # argmax of the raw logits
            every_row = sample_rows == list(range(logits.shape[0]))
            picks = argmax(
                logits if every_row else logits[torch.tensor(sample_rows, device=logits.device)]
            )
            for j, token in enumerate(picks.tolist()):
                results[sample_reqs[j]].tokens.append(token)
        elif sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
            batch_logits = logits[rows]  # a copy: logprobs above stay those of the raw distribution
            if masks is not None:
                bitmask, constrained = masks.result()
                apply_token_bitmask(batch_logits, bitmask.to(batch_logits.device), constrained)
            else:
                self._apply_grammars(batch_logits, [reqs[i] for i in sample_reqs])
            _alternatives(
                batch_logits, [reqs[i] for i in sample_reqs], [results[i] for i in sample_reqs]
            )
            rows_state = [self._sampling_row(reqs[i], []) for i in sample_reqs]
            for j, token in enumerate(
                sample(batch_logits, rows_state, self.execution.sampling).tolist()
            ):
                results[sample_reqs[j]].tokens.append(token)
        for i, first in spec:
            k = len(drafts[i])
            results[i].tokens = self._verify(
                reqs[i], drafts[i], logits[first : first + k + 1].clone()
            )
        if want_logprobs:
            for i, first in [(i, r) for i, r in zip(sample_reqs, sample_rows)] + spec:
                req = reqs[i]
                if not req.logprob.return_logprob:
                    continue
                if results[i].alternatives:
                    picked = logprobs[first, results[i].alternatives]
                    results[i].alternative_logprobs = picked.tolist()
                for j, token in enumerate(results[i].tokens):
                    row_lp = logprobs[first + j]
                    results[i].logprobs.append(row_lp[token].item())
                    if req.logprob.top_logprobs_num:
                        results[i].tops.append(_top(row_lp[None], req.logprob.top_logprobs_num)[0])
        return results

    def _sampling_row(self, req: Request, draft: list[int]) -> SamplingRow:
        output = req.output_ids + draft if draft else req.output_ids
        banned: list[int] = []
        if len(output) < req.params.min_new_tokens:
            banned = sorted(
                set(req.params.stop_token_ids) | set(() if req.params.ignore_eos else self.eos_ids)
            )
        return SamplingRow(
            params=req.params,
            output_ids=output,
            prompt_ids=req.prompt_ids,
            banned_ids=banned,
            generator=req.generator or self.default_generator,
        )

    def _verify(self, req: Request, draft: list[int], logits: torch.Tensor) -> list[int]:
        grammar = req.grammar.copy() if req.grammar is not None else None

        def mask_row(i: int, row_logits: torch.Tensor) -> None:
            if grammar is None:
                return
            if i > 0:
                grammar.advance(draft[i - 1])  # drafts were cut to what the grammar allows
            self._apply_grammars_to(row_logits[None], [grammar])

        return verify_draft(logits, draft, lambda i: self._sampling_row(req, draft[:i]), mask_row)

    @classmethod
    def _apply_grammars(cls, logits: torch.Tensor, reqs: list[Request]) -> None:
        cls._apply_grammars_to(logits, [r.grammar for r in reqs])

    @staticmethod
    def _apply_grammars_to(logits: torch.Tensor, grammars: list) -> None:
        """Masks each constrained row to the tokens its grammar allows next (one kernel call)."""
        if all(g is None for g in grammars):
            return
        from plait.runtime.constrained.base import fill_bitmasks

        bitmask = allocate_token_bitmask(len(grammars), logits.shape[1])
        constrained = fill_bitmasks(grammars, bitmask)
        apply_token_bitmask(logits, bitmask.to(logits.device), constrained)


@cache
def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _fill_masks(grammars: list, vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    from plait.runtime.constrained.base import fill_bitmasks

    bitmask = allocate_token_bitmask(len(grammars), vocab_size)
    return bitmask, fill_bitmasks(grammars, bitmask)


def _plain_logits(req: Request) -> bool:
    """Whether the request's next token depends on nothing but its raw logits and its sampling
    parameters: no grammar, no penalty, no token banned."""
    p = req.params
    return (
        req.grammar is None
        and not p.frequency_penalty
        and not p.presence_penalty
        and p.repetition_penalty == 1.0
        and len(req.output_ids) >= p.min_new_tokens
    )


def _burst_logits(req: Request) -> bool:
    """Whether a burst can pick the request's tokens: as `_plain_logits`, but a grammar is
    allowed (masked between the burst's steps), unless token healing may still lift it."""
    p = req.params
    return (
        not req.heal_free
        and not p.frequency_penalty
        and not p.presence_penalty
        and p.repetition_penalty == 1.0
        and len(req.output_ids) >= p.min_new_tokens
    )


def _plain_greedy(req: Request) -> bool:
    """Whether the request's next token is the argmax of its raw logits: greedy, no grammar, no
    penalty, no token banned (`_sampling_row`: stop and EOS ids before `min_new_tokens`)."""
    return req.params.is_greedy and _plain_logits(req)


class _BetweenSteps:
    """The kernel's callback before each step of a burst: the hooks in turn (streams, then grammar
    masks), any of them ending the burst. An exception a hook raises ends it too and is kept in
    `error`, for the caller to raise once the native call has returned."""

    def __init__(
        self, hooks: list[Callable[[int], bool]], rows: int, grammars: GrammarBurst | None
    ) -> None:
        self._hooks = hooks
        self.error: BaseException | None = None
        self._fn = MASK_FN(self._call)  # referenced here for the burst's duration
        if grammars is not None:
            bitmask, masked = grammars.bitmask, grammars.masked
        else:  # no row is masked
            bitmask, masked = (
                torch.zeros(rows, 1, dtype=torch.int32),
                torch.zeros(rows, dtype=torch.int32),
            )
        self.masks = BurstMasks(self._fn, bitmask, masked)

    def _call(self, step: int) -> int:
        try:
            return int(any(hook(step) for hook in self._hooks))
        except BaseException as exc:  # noqa: BLE001 - raised by the caller once the burst returned
            self.error = exc
            return 1


def _alternatives(logits: torch.Tensor, reqs: list[Request], results: list[TokenResult]) -> None:
    """The allowed tokens a request steering toward its closing may take instead of the sampled
    one (`budget_closing.py`): its `CLOSING_CANDIDATES` best by the masked logits."""
    rows = [j for j, req in enumerate(reqs) if req.closing_path is not None]
    if not rows:
        return
    k = min(CLOSING_CANDIDATES, logits.shape[-1])
    values, ids = logits[torch.tensor(rows, device=logits.device)].topk(k, dim=-1)  # [rows, k]
    for j, row_values, row_ids in zip(rows, values.tolist(), ids.tolist()):
        results[j].alternatives = [t for v, t in zip(row_values, row_ids) if v != float("-inf")]


def _top(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
