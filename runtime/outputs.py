"""The native response shape (SGLang-compatible) built from a request's state."""

from __future__ import annotations

import time
from typing import Any

from plait.runtime.protocol import FinishReason
from plait.runtime.request import Request
from plait.runtime.tokenizer import Tokenizer


def _entry(logprob: float | None, token: int, tokenizer: Tokenizer, with_text: bool) -> list[Any]:
    return [
        logprob,
        token,
        tokenizer.decode([token], skip_special_tokens=False) if with_text else None,
    ]


def _top_entries(
    tops: list[list[tuple[float, int]] | None], tokenizer: Tokenizer, with_text: bool
) -> list[Any]:
    return [
        None if top is None else [_entry(lp, tok, tokenizer, with_text) for lp, tok in top]
        for top in tops
    ]


def build_output(req: Request, tokenizer: Tokenizer, text: str) -> dict[str, Any]:
    end = req.finish_time or time.perf_counter()
    reason = req.finish_reason
    if (
        req.closing.closed_early
        and reason is not None
        and req.sampling.params.closed_finish_reason == "stop"
    ):
        reason = FinishReason("stop")  # the output is complete; `closed_early` still says how
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": reason.to_dict() if reason else None,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": req.num_output_tokens,
        "cached_tokens": req.cached_tokens,
        "e2e_latency": end - req.arrival_time,
    }
    if req.constraint.grammar is not None:
        meta["jump_forward_tokens"] = req.constraint.jump_forward_tokens
        meta["closed_early"] = req.closing.closed_early
    if req.healing.text:  # token healing: the backed-up text is the prompt's, not the output's
        meta["healed_text"] = req.healing.text
        text = text[len(req.healing.text) :] if text.startswith(req.healing.text) else text[:0]
    if req.spec.num_steps:
        meta["spec_verify_ct"] = req.spec.num_steps
        meta["spec_accepted_tokens"] = req.spec.num_accepted
    opts = req.sampling.logprob
    if opts.return_logprob:
        with_text = opts.return_text_in_logprobs
        meta["input_token_logprobs"] = [
            _entry(lp, tok, tokenizer, with_text) for lp, tok in req.input_token_logprobs
        ]
        meta["output_token_logprobs"] = [
            _entry(lp, tok, tokenizer, with_text) for lp, tok in req.output_token_logprobs
        ]
        if opts.top_logprobs_num:
            meta["input_top_logprobs"] = _top_entries(req.input_top_logprobs, tokenizer, with_text)
            meta["output_top_logprobs"] = _top_entries(
                req.output_top_logprobs, tokenizer, with_text
            )
        else:
            meta["input_top_logprobs"] = []
            meta["output_top_logprobs"] = []
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
