"""TP=2 on the embedded SmolLM2 (9 query / 3 KV heads: ranks hold 2 and 1 KV-head groups) over
gloo: the same greedy answers and, within float32 tolerance, the same logits as TP=1."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


def test_tp2_matches_tp1_on_the_default_model(default_engine):
    from plait import Engine

    tok = default_engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = {"max_new_tokens": 16, "temperature": 0}

    def run(engine):
        return engine.generate(prompts, params, return_logprob=True, logprob_start_len=0)

    reference = run(default_engine)
    with Engine(tp_size=2, max_total_tokens=4096) as parallel:
        outs = run(parallel)
    for ref, par in zip(reference, outs):
        assert par["text"] == ref["text"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got = [lp for lp, _, _ in par["meta_info"][key] if lp is not None]
            want = [lp for lp, _, _ in ref["meta_info"][key] if lp is not None]
            assert got == pytest.approx(want, abs=2e-3)
