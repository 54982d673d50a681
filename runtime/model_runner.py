"""The only code that turns scheduling state into tensors: builds a ragged batch, runs the model,
computes logprobs and samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plait.kernels.attention import AttentionMetadata
from plait.kernels.constraint_mask import allocate_token_bitmask, apply_token_bitmask
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.kv_pool import KVPool
from plait.runtime.models.llama import LlamaForCausalLM
from plait.runtime.request import Request
from plait.runtime.sampling import SamplingRow, sample


@dataclass
class ExtendEntry:
    """Compute KV for `req.all_ids[start:end]`; positions before `start` are already cached."""

    req: Request
    start: int
    end: int
    is_last_chunk: bool


@dataclass
class ScheduleBatch:
    extends: list[ExtendEntry] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(e.end - e.start for e in self.extends) + len(self.decodes)

    def __bool__(self) -> bool:
        return bool(self.extends or self.decodes)


@dataclass
class TokenResult:
    """What one forward pass produced for one request."""

    next_token: int | None = None
    next_logprob: float | None = None
    next_top: list[tuple[float, int]] | None = None
    input_logprobs: list[tuple[float, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]]] = field(default_factory=list)


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    forward_batch: ForwardBatch
    plans: list[tuple[list[int], bool]]  # per entry: input-logprob rows, samples a token


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_pool: KVPool,
        device: torch.device,
        eos_ids: frozenset[int],
        default_generator: torch.Generator,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.page_size = kv_pool.page_size
        self.eos_ids = eos_ids
        self.default_generator = default_generator

    def slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """KV slots of token positions [start, end) of a request with page table `pages`."""
        if self.page_size == 1:
            return torch.tensor(pages[start:end], dtype=torch.long)
        positions = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(pages, dtype=torch.long)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def prepare(self, batch: ScheduleBatch) -> PreparedBatch:
        """Builds the step's tensors from the batch's Python state."""
        ids: list[int] = []
        positions: list[int] = []
        slot_chunks: list[torch.Tensor] = []
        q_starts, q_lens, kv_lens, kv_slots = [], [], [], []
        logit_rows: list[int] = []
        plans: list[tuple[list[int], bool]] = []
        for e in batch.extends:
            req = e.req
            row0 = len(ids)
            ids.extend(req.all_ids[e.start : e.end])
            positions.extend(range(e.start, e.end))
            all_slots = self.slots(req.pages, 0, e.end)
            slot_chunks.append(all_slots[e.start :])
            q_starts.append(row0)
            q_lens.append(e.end - e.start)
            kv_lens.append(e.end)
            kv_slots.append(all_slots)
            input_rows = self._input_logprob_rows(e)
            logit_rows.extend(row0 + r - e.start for r in input_rows)
            samples = e.is_last_chunk and req.params.max_new_tokens > len(req.output_ids)
            if samples:
                logit_rows.append(row0 + e.end - 1 - e.start)
            plans.append((input_rows, samples))
        decode_slots = decode_lens = decode_mask = None
        if batch.decodes:
            lens = [r.num_tokens for r in batch.decodes]
            width = max(lens)
            table = torch.zeros(len(lens), width, dtype=torch.long)
            for i, r in enumerate(batch.decodes):
                logit_rows.append(len(ids))
                ids.append(r.all_ids[-1])
                positions.append(lens[i] - 1)
                s = self.slots(r.pages, 0, lens[i])
                table[i, : lens[i]] = s
                slot_chunks.append(s[-1:])
                plans.append(([], True))
            decode_lens = torch.tensor(lens, dtype=torch.long)
            decode_mask = (torch.arange(width)[None, :] < decode_lens[:, None])[:, None, None, :]
            decode_slots = table.to(self.device)
            decode_lens = decode_lens.to(self.device)
            decode_mask = decode_mask.to(self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_chunks).to(self.device),
            extend_q_starts=q_starts,
            extend_q_lens=q_lens,
            extend_kv_lens=kv_lens,
            extend_kv_slots=[s.to(self.device) for s in kv_slots],
            decode_kv_slots=decode_slots,
            decode_kv_lens=decode_lens,
            decode_mask=decode_mask,
        )
        forward_batch = ForwardBatch(
            kv_pool=self.kv_pool,
            attn=meta,
            logits_indices=torch.tensor(logit_rows, dtype=torch.long, device=self.device),
        )
        return PreparedBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            forward_batch=forward_batch,
            plans=plans,
        )

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch) -> list[TokenResult]:
        """Runs one step; results align with `batch.extends + batch.decodes`."""
        prepared = self.prepare(batch)
        logits = self.model(prepared.input_ids, prepared.positions, prepared.forward_batch)
        return self._results(batch, prepared.plans, logits)  # logits: [num_logit_rows, vocab]

    def _input_logprob_rows(self, e: ExtendEntry) -> list[int]:
        """Positions r in [start, end) whose logits score prompt token r + 1 for input logprobs."""
        req = e.req
        if not req.logprob.return_logprob:
            return []
        prompt_len = len(req.prompt_ids)
        done = max(len(req.input_token_logprobs) - 1, 0)
        first = max(e.start, req.logprob_start + done)
        return list(range(first, min(e.end, prompt_len - 1)))

    def _results(
        self, batch: ScheduleBatch, plans: list[tuple[list[int], bool]], logits: torch.Tensor
    ) -> list[TokenResult]:
        reqs = [e.req for e in batch.extends] + batch.decodes
        results = [TokenResult() for _ in reqs]
        want_logprobs = any(r.logprob.return_logprob for r in reqs)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        sample_rows: list[int] = []
        sample_reqs: list[int] = []
        cursor = 0
        for i, (req, (input_rows, samples)) in enumerate(zip(reqs, plans)):
            if input_rows:
                n = len(input_rows)
                targets = torch.tensor(
                    [req.all_ids[r + 1] for r in input_rows], dtype=torch.long, device=logits.device
                )
                lp = logprobs[cursor : cursor + n].gather(1, targets[:, None])[:, 0].tolist()
                results[i].input_logprobs = list(zip(lp, targets.tolist()))
                if req.logprob.top_logprobs_num:
                    results[i].input_top = _top(logprobs[cursor : cursor + n], req.logprob.top_logprobs_num)
                cursor += n
            if samples:
                sample_rows.append(cursor)
                sample_reqs.append(i)
                cursor += 1
        if not sample_rows:
            return results
        rows = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
        batch_logits = logits[rows]  # a copy: logprobs above stay those of the raw distribution
        self._apply_grammars(batch_logits, [reqs[i] for i in sample_reqs])
        sampling_rows = [
            SamplingRow(
                params=reqs[i].params,
                output_ids=reqs[i].output_ids,
                prompt_ids=reqs[i].prompt_ids,
                banned_ids=reqs[i].banned_ids(self.eos_ids),
                generator=reqs[i].generator or self.default_generator,
            )
            for i in sample_reqs
        ]
        next_ids = sample(batch_logits, sampling_rows).tolist()
        for j, i in enumerate(sample_reqs):
            results[i].next_token = next_ids[j]
            req = reqs[i]
            if req.logprob.return_logprob:
                row_lp = logprobs[sample_rows[j]]
                results[i].next_logprob = row_lp[next_ids[j]].item()
                if req.logprob.top_logprobs_num:
                    results[i].next_top = _top(row_lp[None], req.logprob.top_logprobs_num)[0]
        return results


    @staticmethod
    def _apply_grammars(logits: torch.Tensor, reqs: list[Request]) -> None:
        """Masks each constrained row to the tokens its grammar allows next (one kernel call)."""
        constrained = [j for j, r in enumerate(reqs) if r.grammar is not None]
        if not constrained:
            return
        bitmask = allocate_token_bitmask(len(reqs), logits.shape[1])
        for j in constrained:
            reqs[j].grammar.fill_bitmask(bitmask, j)
        apply_token_bitmask(logits, bitmask.to(logits.device), constrained)


def _top(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
