"""Drafting with a model: a smaller model sharing the tokenizer (`draft_model`, its own KV pool
indexed by the same page tables), or the target's own first layers and LM head (`self`, writing
the target's KV for those layers, which verification recomputes identically)."""

from __future__ import annotations

from typing import Any

from plait.runtime.batch import ScheduleBatch, VerifyEntry
from plait.runtime.model_runner import ModelRunner
from plait.runtime.request import Request
from plait.runtime.speculative.base import DraftContext, Drafter


class ModelDrafter(Drafter):
    def __init__(self, context: DraftContext, name: str, **_: Any) -> None:
        self.name = name
        self.kv = context.kv
        num_target_layers = context.args.num_layers
        if name == "self":
            num_layers = context.config.draft_layers or max(num_target_layers // 4, 1)
            if num_layers >= num_target_layers:
                raise ValueError(
                    f"draft_layers: must be below the model's {num_target_layers} layers, "
                    f"got {num_layers}"
                )
            self.num_layers: int | None = num_layers
            self.runner = context.runner
            self.own_kv = False
        else:
            self.num_layers = None
            self.runner = self._load_draft_runner(context)
            self.own_kv = True

    @staticmethod
    def _load_draft_runner(context: DraftContext) -> ModelRunner:
        from plait.runtime.kv_pool import KVPool
        from plait.runtime.model_loader import load_model

        c = context
        loaded = load_model(c.config.draft_model_path, c.dtype, c.device)
        if loaded.args.vocab_size != c.args.vocab_size:
            raise ValueError(
                f"draft_model_path: vocabulary {loaded.args.vocab_size} differs from the target's "
                f"{c.args.vocab_size}; the draft must share the tokenizer"
            )
        a = loaded.args
        pool = KVPool(
            c.num_pages, c.page_size, a.num_layers, a.num_kv_heads, a.head_dim, c.dtype, c.device
        )
        return ModelRunner(
            loaded.model,
            pool,
            c.device,
            c.eos_token_ids,
            c.generator,
            page_rows=c.runner.tables.rows,
        )

    def propose(self, reqs: list[Request], num_tokens: int) -> list[list[int]]:
        ready = [r for r in reqs if self.kv.grow(r, r.num_tokens + num_tokens)]
        drafts: dict[Request, list[int]] = {r: [] for r in ready}
        for _ in range(num_tokens):
            if not ready:
                break
            entries = []
            for r in ready:
                n = r.num_tokens
                start = min(r.spec.draft_valid, n - 1) if self.own_kv else n - 1
                entries.append(VerifyEntry(r, start, n, drafts[r]))
            logits = self.runner.last_logits(ScheduleBatch(verifies=entries), self.num_layers)
            picks = self.runner.execution.sampling.argmax(logits).tolist()
            for r, e, token in zip(ready, entries, picks):
                if self.own_kv:
                    r.spec.draft_valid = e.end + len(e.draft_ids)
                drafts[r].append(token)
        return [drafts.get(r, []) for r in reqs]

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        super().observe(req, proposed, accepted)
        # draft KV holds the accepted drafts; the bonus token and rejected ones are recomputed
        req.spec.draft_valid = min(req.spec.draft_valid, req.num_tokens - 1)
