"""From a forward pass's logits to each entry's `TokenResult`: prompt logprobs, the next token (the
argmax of raw logits, or grammar masks then sampling), speculative drafts verified, output
logprobs, and the alternatives budget-aware closing may take. Grammar masks of the sampled rows
are filled on another thread while the forward runs, where a core is free for it."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from plait.kernels.constraint_mask import allocate_token_bitmask, choose_bitmask_apply
from plait.runtime.batch import ScheduleBatch, TokenResult
from plait.runtime.request import Request
from plait.runtime.sampling import Sampler, SamplingRow
from plait.runtime.speculative.verify import verify_draft
from plait.runtime.tuning import CLOSING_CANDIDATES


class StepTokens:
    """`sampler`: the engine's next-token picks, greedy and sampled (`Execution.sampling`)."""

    def __init__(
        self,
        device: torch.device,
        vocab_size: int,
        eos_ids: frozenset[int],
        default_generator: torch.Generator,
        sampler: Sampler,
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.default_generator = default_generator
        self.sampler = sampler
        self._apply_mask = choose_bitmask_apply(device)
        # on the CPU the forward may take every core, and then the masks wait for it (`start_masks`)
        self._cpu_cores = _usable_cpus() if device.type == "cpu" else None
        # fills grammar masks beside the forward; its thread starts with the first masks
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-masks")

    def start_masks(
        self, batch: ScheduleBatch, plans: list[tuple[list[int], bool]]
    ) -> Future[tuple[torch.Tensor, list[int]]] | None:
        """Fills the grammar masks of the step's sampled rows on another thread while the
        forward pass runs (the masks depend on the grammars' states only; llguidance releases
        the GIL). Rows in the order `results` samples them: one-token entries, no drafts."""
        reqs, drafts = batch.requests(), batch.drafts()
        grammars = [
            r.constraint.grammar
            for r, (_, samples) in zip(reqs, plans)
            if samples and r not in drafts
        ]
        if all(g is None for g in grammars):
            return None
        if self._cpu_cores is not None and torch.get_num_threads() >= self._cpu_cores:
            # NOTE: every core runs the forward (the thread policy sets the count each step): a
            # mask thread beside it preempts one of its OpenMP threads, which the others then wait
            # for at each barrier, and both run slower than one after the other; filled after the
            # forward instead (`results`)
            return None
        return self._mask_pool.submit(_fill_masks, grammars, self.vocab_size)

    def results(
        self,
        batch: ScheduleBatch,
        plans: list[tuple[list[int], bool]],
        logits: torch.Tensor,
        masks: Future[tuple[torch.Tensor, list[int]]] | None = None,
    ) -> list[TokenResult]:
        reqs, drafts = batch.requests(), batch.drafts()
        results = [TokenResult() for _ in reqs]
        want_logprobs = any(r.sampling.logprob.return_logprob for r in reqs)
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
                if req.sampling.logprob.top_logprobs_num:
                    results[i].input_top = _top(
                        logprobs[cursor : cursor + n], req.sampling.logprob.top_logprobs_num
                    )
                cursor += n
            if samples and req in drafts:
                spec.append((i, cursor))
                cursor += len(drafts[req]) + 1
            elif samples:
                sample_rows.append(cursor)
                sample_reqs.append(i)
                cursor += 1
        if sample_rows and all(
            _plain_greedy(reqs[i]) for i in sample_reqs
        ):  # argmax of the raw logits
            every_row = sample_rows == list(range(logits.shape[0]))
            picks = self.sampler.argmax(
                logits if every_row else logits[torch.tensor(sample_rows, device=logits.device)]
            )
            for j, token in enumerate(picks.tolist()):
                results[sample_reqs[j]].tokens.append(token)
        elif sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
            batch_logits = logits[rows]  # a copy: logprobs above stay those of the raw distribution
            if masks is not None:
                bitmask, constrained = masks.result()
                self._apply_mask(batch_logits, bitmask.to(batch_logits.device), constrained)
            else:
                self._apply_grammars(batch_logits, [reqs[i] for i in sample_reqs])
            _alternatives(
                batch_logits, [reqs[i] for i in sample_reqs], [results[i] for i in sample_reqs]
            )
            rows_state = [self._sampling_row(reqs[i], []) for i in sample_reqs]
            for j, token in enumerate(self.sampler.sample(batch_logits, rows_state).tolist()):
                results[sample_reqs[j]].tokens.append(token)
        for i, first in spec:
            draft = drafts[reqs[i]]
            results[i].tokens = self._verify(
                reqs[i], draft, logits[first : first + len(draft) + 1].clone()
            )
        if want_logprobs:
            for i, first in [(i, r) for i, r in zip(sample_reqs, sample_rows)] + spec:
                opts = reqs[i].sampling.logprob
                if not opts.return_logprob:
                    continue
                if results[i].alternatives:
                    picked = logprobs[first, results[i].alternatives]
                    results[i].alternative_logprobs = picked.tolist()
                for j, token in enumerate(results[i].tokens):
                    row_lp = logprobs[first + j]
                    results[i].logprobs.append(row_lp[token].item())
                    if opts.top_logprobs_num:
                        results[i].tops.append(_top(row_lp[None], opts.top_logprobs_num)[0])
        return results

    def _sampling_row(self, req: Request, draft: list[int]) -> SamplingRow:
        output = req.output_ids + draft if draft else req.output_ids
        p = req.sampling.params
        banned: list[int] = []
        if len(output) < p.min_new_tokens:
            banned = req.sampling.stop_ids(self.eos_ids)
        return SamplingRow(
            params=p,
            output_ids=output,
            prompt_ids=req.prompt_ids,
            banned_ids=banned,
            generator=req.sampling.generator or self.default_generator,
        )

    def _verify(self, req: Request, draft: list[int], logits: torch.Tensor) -> list[int]:
        grammar = req.constraint.grammar.copy() if req.constraint.grammar is not None else None

        def mask_row(i: int, row_logits: torch.Tensor) -> None:
            if grammar is None:
                return
            if i > 0:
                grammar.advance(draft[i - 1])  # drafts were cut to what the grammar allows
            self._apply_grammars_to(row_logits[None], [grammar])

        return verify_draft(
            logits,
            draft,
            lambda i: self._sampling_row(req, draft[:i]),
            mask_row,
            sampler=self.sampler,
        )

    def _apply_grammars(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        self._apply_grammars_to(logits, [r.constraint.grammar for r in reqs])

    def _apply_grammars_to(self, logits: torch.Tensor, grammars: list) -> None:
        """Masks each constrained row to the tokens its grammar allows next (one kernel call)."""
        if all(g is None for g in grammars):
            return
        from plait.runtime.constrained.base import fill_bitmasks

        bitmask = allocate_token_bitmask(len(grammars), logits.shape[1])
        constrained = fill_bitmasks(grammars, bitmask)
        self._apply_mask(logits, bitmask.to(logits.device), constrained)


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
    p = req.sampling.params
    return (
        req.constraint.grammar is None
        and not p.frequency_penalty
        and not p.presence_penalty
        and p.repetition_penalty == 1.0
        and len(req.output_ids) >= p.min_new_tokens
    )


def _plain_greedy(req: Request) -> bool:
    """Whether the request's next token is the argmax of its raw logits: greedy, no grammar, no
    penalty, no token banned (`_sampling_row`: stop and EOS ids before `min_new_tokens`)."""
    return req.sampling.params.is_greedy and _plain_logits(req)


def _alternatives(logits: torch.Tensor, reqs: list[Request], results: list[TokenResult]) -> None:
    """The allowed tokens a request steering toward its closing may take instead of the sampled
    one (`budget_closing.py`): its `CLOSING_CANDIDATES` best by the masked logits."""
    rows = [j for j, req in enumerate(reqs) if req.closing.path is not None]
    if not rows:
        return
    k = min(CLOSING_CANDIDATES, logits.shape[-1])
    values, ids = logits[torch.tensor(rows, device=logits.device)].topk(k, dim=-1)  # [rows, k]
    for j, row_values, row_ids in zip(rows, values.tolist(), ids.tolist()):
        results[j].alternatives = [t for v, t in zip(row_values, row_ids) if v != float("-inf")]


def _top(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
