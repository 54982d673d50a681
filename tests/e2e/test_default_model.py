"""The embedded SmolLM2-135M-Instruct: plait agrees with transformers loading the same GGUF."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nList three colors.<|im_end|>\n<|im_start|>assistant\n",
    "In 1492, Columbus sailed across the Atlantic. Numbers: 3.14159, 2718; emoji 🙂 and 日本語.",
]


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    return model.eval()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_logprobs_and_greedy_match_transformers(default_engine, hf_model, prompt):
    ids = default_engine.tokenizer.encode(prompt)
    out = default_engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
    )
    ours = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
        ref = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        # NOTE: an explicit attention mask: the prompt contains <|im_end|>, which is also the pad
        # id, and transformers would otherwise mask it out as padding.
        hf_ids = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=2,
            eos_token_id=None,
        )[0, len(ids) :].tolist()
    assert (ours - ref).abs().max().item() < 2e-3
    assert out["output_ids"] == hf_ids


def test_chat_answer_is_sensible(default_engine):
    prompt = default_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    out = default_engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


def test_stop_string_split_across_tokens_on_real_model(default_engine):
    params = {"max_new_tokens": 16, "temperature": 0}
    full = default_engine.generate("1, 2, 3, 4,", params)["text"]
    assert full.startswith(" 5, 6, 7")
    out = default_engine.generate("1, 2, 3, 4,", {**params, "stop": [", 6"]})
    assert out["text"] == " 5"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ", 6"}
