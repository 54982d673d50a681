"""Decode bursts: up to `steps` decode steps of a batch in one native call (the native stack's
embedding, layers, final norm, LM head and sampler), with no Python between the steps but the
hooks it is given. The step planner plans them (`bursts.py` decides how long), `ModelRunner.execute`
runs them through `BurstRunner.run`; `burst_streams.py` hands streaming rows their tokens between
steps and `constrained/burst_masks.py` fills grammar masks there."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from plait.kernels import sampling_cpu
from plait.kernels.decode_stack import MASK_FN, BurstMasks, BurstSampling
from plait.runtime.batch import ScheduleBatch, TokenResult
from plait.runtime.constrained.burst_masks import GrammarBurst
from plait.runtime.execution import Execution
from plait.runtime.models.llama import LlamaForCausalLM
from plait.runtime.page_tables import PageTables
from plait.runtime.request import Request
from plait.runtime.sampling import filter_params


class BurstRunner:
    """Runs a model's bursts; built by its `ModelRunner`, which lays out the same page spaces
    (`spaces`: (in window pages, the window of their CPU rows) per space)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        execution: Execution,
        tables: PageTables,
        spaces: list[tuple[bool, int | None]],
        eos_ids: frozenset[int],
        default_generator: torch.Generator,
        jump_forward: bool,
    ) -> None:
        self.model = model
        self.execution = execution
        self.stack = execution.native_stack
        self.tables = tables
        self._spaces = spaces
        self.eos_ids = eos_ids
        self.default_generator = default_generator
        self.jump_forward = jump_forward  # the engine jumps over forced text: bursts end there
        # sampled rows burst where the native sampler built; else greedy ones alone
        self.native_sampler = sampling_cpu.available()

    def can_run(self, batch: ScheduleBatch) -> bool:
        """Whether `run` can run this batch: decodes only, each one's next token a function
        of its raw logits and its grammar's mask (greedy, or sampled with no penalty), no
        logprobs, and a model whose whole step runs natively (the CPU kernels)."""
        if batch.queried or not self.execution.can_burst(len(batch.decodes)):
            return False
        if not all(
            _burst_logits(r) and not r.sampling.logprob.return_logprob for r in batch.decodes
        ):
            return False
        return self.native_sampler or all(r.sampling.params.is_greedy for r in batch.decodes)

    @torch.inference_mode()
    def run(
        self,
        batch: ScheduleBatch,
        steps: int,
        interrupt: ctypes.c_int32 | None = None,
        out: torch.Tensor | None = None,
        between_steps: Callable[[int], bool] | None = None,
    ) -> list[TokenResult]:
        """Up to `steps` decode steps of `batch.decodes` in one native call (see `can_run`);
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
        stop_ids = [r.sampling.stop_ids(self.eos_ids) for r in reqs]
        stack = self.stack
        sampling, rewind = self._sampling(reqs, steps)
        hooks = [] if between_steps is None else [between_steps]
        grammars = None
        if any(r.constraint.grammar is not None for r in reqs):
            if out is None:
                out = torch.full((len(reqs), steps), -1, dtype=torch.long)
            grammars = GrammarBurst(
                [r.constraint.grammar for r in reqs],
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

    def _sampling(
        self, reqs: list[Request], steps: int
    ) -> tuple[BurstSampling | None, list[tuple[torch.Generator, torch.Tensor]]]:
        """A burst's sampling parameters and uniforms (None when every row is greedy), and the
        request generators to rewind, with their states before the draw."""
        if all(r.sampling.params.is_greedy for r in reqs):
            return None, []
        vocab = self.model.lm_head.out_features
        uniforms = torch.zeros(len(reqs), steps)
        rewind = []
        for i, r in enumerate(reqs):
            if r.sampling.params.is_greedy:
                continue
            generator = r.sampling.generator
            if generator is not None:  # a seeded request's own; the shared default is not rewound
                rewind.append((generator, generator.get_state()))
            uniforms[i] = torch.rand(steps, generator=generator or self.default_generator)
        temperature, top_k, top_p, min_p = filter_params([r.sampling.params for r in reqs], vocab)
        return BurstSampling(temperature, top_k, top_p, min_p, uniforms), rewind


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


def _burst_logits(req: Request) -> bool:
    """Whether a burst can pick the request's tokens: as `_plain_logits`, but a grammar is
    allowed (masked between the burst's steps), unless token healing may still lift it."""
    p = req.sampling.params
    return (
        not req.healing.free
        and not p.frequency_penalty
        and not p.presence_penalty
        and p.repetition_penalty == 1.0
        and len(req.output_ids) >= p.min_new_tokens
    )
