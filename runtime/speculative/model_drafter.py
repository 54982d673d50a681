"""Drafting with a model: a smaller model sharing the tokenizer (`draft_model`, its own KV pool
indexed by the same page tables), or the target's own first layers and LM head (`self`, writing
the target's KV for those layers, which verification recomputes identically)."""

from __future__ import annotations

from typing import Any

from plait.runtime.batch import ScheduleBatch, VerifyEntry
from plait.runtime.model_runner import ModelRunner
from plait.runtime.request import Request
from plait.runtime.sampling import argmax
from plait.runtime.speculative.base import Drafter


class ModelDrafter(Drafter):
    def __init__(self, engine: Any, name: str, **_: Any) -> None:
        self.name = name
        self.engine = engine
        if name == "self":
            num_layers = engine.config.draft_layers or max(engine.args.num_layers // 4, 1)
            if num_layers >= engine.args.num_layers:
                raise ValueError(
                    f"draft_layers: must be below the model's {engine.args.num_layers} layers, "
                    f"got {num_layers}"
                )
            self.num_layers: int | None = num_layers
            self.runner = engine.runner
            self.own_kv = False
        else:
            self.num_layers = None
            self.runner = self._load_draft_runner(engine)
            self.own_kv = True

    @staticmethod
    def _load_draft_runner(engine: Any) -> ModelRunner:
        from plait.runtime.kv_pool import KVPool
        from plait.runtime.model_loader import load_model

        loaded = load_model(engine.config.draft_model_path, engine.dtype, engine.device)
        if loaded.args.vocab_size != engine.args.vocab_size:
            raise ValueError(
                f"draft_model_path: vocabulary {loaded.args.vocab_size} differs from the target's "
                f"{engine.args.vocab_size}; the draft must share the tokenizer"
            )
        a = loaded.args
        pool = KVPool(
            engine.kv_pool.num_pages,
            engine.page_size,
            a.num_layers,
            a.num_kv_heads,
            a.head_dim,
            engine.dtype,
            engine.device,
        )
        return ModelRunner(
            loaded.model, pool, engine.device, engine.tokenizer.eos_token_ids, engine.generator
        )

    def propose(self, reqs: list[Request], num_tokens: int) -> list[list[int]]:
        kv = self.engine.scheduler.kv
        ready = [r for r in reqs if kv.grow(r, r.num_tokens + num_tokens)]
        drafts: dict[int, list[int]] = {id(r): [] for r in ready}
        for _ in range(num_tokens):
            if not ready:
                break
            entries = []
            for r in ready:
                n = r.num_tokens
                start = min(r.spec.draft_valid, n - 1) if self.own_kv else n - 1
                entries.append(VerifyEntry(r, start, n, drafts[id(r)]))
            logits = self.runner.last_logits(ScheduleBatch(verifies=entries), self.num_layers)
            for r, e, token in zip(ready, entries, argmax(logits).tolist()):
                if self.own_kv:
                    r.spec.draft_valid = e.end + len(e.draft_ids)
                drafts[id(r)].append(token)
        return [drafts.get(id(r), []) for r in reqs]

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        super().observe(req, proposed, accepted)
        # draft KV holds the accepted drafts; the bonus token and rejected ones are recomputed
        req.spec.draft_valid = min(req.spec.draft_valid, req.num_tokens - 1)
