"""Speculative decoding as the engine loop runs it: the drafter (none when it is off), the policy
that decides each step whether to draft (`policies.SpeculationPolicy`), and the totals `stats()`
reports. The drafters themselves and the verification are in `speculative/`."""

from __future__ import annotations

from typing import Any

from plait.runtime.batch import ScheduleBatch
from plait.runtime.config import EngineConfig
from plait.runtime.policies import SpeculationPolicy
from plait.runtime.request import Request
from plait.runtime.speculative.base import DraftContext


class Speculation:
    def __init__(self, config: EngineConfig, context: DraftContext) -> None:
        """`context`: what the drafter may use of the engine (its runner, shapes, KV pages)."""
        self.config = config
        self.drafter: Any = None
        if config.speculative_algorithm is not None:
            from plait.runtime.speculative import create_drafter

            self.drafter = create_drafter(config.speculative_algorithm, context=context)
        self.policy = SpeculationPolicy(config.speculation)
        self.governor = self.policy.governor
        self.totals = {"steps": 0, "proposed": 0, "accepted": 0}

    def speculate(self, batch: ScheduleBatch) -> bool:
        """Whether this step's decodes draft."""
        return (
            self.drafter is not None
            and bool(batch.decodes)
            and self.policy.speculate(len(batch.decodes))
        )

    def propose(self, decodes: list[Request], context_len: int) -> dict[Request, list[int]]:
        """Drafts for `decodes`, by request, each cut to the request's room and, under a
        grammar, to the tokens it allows; a request without one is left out."""
        candidates = [r for r in decodes if self.drafter.wants(r)]
        if not candidates:
            return {}
        k = self.config.num_draft_tokens
        drafts: dict[Request, list[int]] = {}
        for req, draft in zip(candidates, self.drafter.propose(candidates, k)):
            room = req.tokens_left(context_len) - 1  # the verification adds a token of its own
            draft = draft[: max(room, 0)]
            if draft and req.constraint.grammar is not None:
                grammar = req.constraint.grammar.copy()
                allowed = 0
                while allowed < len(draft) and grammar.try_advance(draft[allowed]):
                    allowed += 1
                draft = draft[:allowed]
            if draft:
                drafts[req] = draft
        return drafts

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        self.drafter.observe(req, proposed, accepted)
        req.spec.num_steps += 1
        req.spec.num_proposed += proposed
        req.spec.num_accepted += accepted
        self.totals["steps"] += 1
        self.totals["proposed"] += proposed
        self.totals["accepted"] += accepted

    def stats(self) -> dict[str, Any]:
        if self.config.speculative_algorithm is None:
            return {}
        t = self.totals
        return {
            "spec_algorithm": self.config.speculative_algorithm,
            "spec_mode": self.policy.mode,
            "spec_verify_steps": t["steps"],
            "spec_proposed_tokens": t["proposed"],
            "spec_accepted_tokens": t["accepted"],
            "spec_acceptance_rate": t["accepted"] / t["proposed"] if t["proposed"] else 0.0,
            "spec_mean_accept_length": (t["accepted"] + t["steps"]) / t["steps"]
            if t["steps"]
            else 0.0,
        }
