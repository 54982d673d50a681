"""Every family against transformers on a tiny random checkpoint of its own config, through the
Engine: greedy tokens, prompt logprobs, and the serving paths that must not change them (a cached
prefix, a batch, a prefill in chunks)."""

from __future__ import annotations

import pytest
import torch

from plait import Engine
from tests.conftest import write_tiny_checkpoint

NEW_TOKENS = 64
TOL = 1e-3

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}
# family, config overrides, what the engine's execution must say about its layers
CASES = {
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}, "native stack"),
    "qwen3": ("qwen3", {"head_dim": 16}, "native stack"),
    "phi3": ("phi3", {"sliding_window": 24}, "native stack"),
    "gemma3": (
        "gemma3",
        {
            "head_dim": 32,
            "num_hidden_layers": 3,
            "sliding_window": 12,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "final_logit_softcapping": 30.0,
        },
        "native stack",
    ),
    # mixtures of experts: 4 experts, 2 per token (Mixtral with a sliding window; Qwen3-MoE
    # with q/k norms, a dense MLP in its first layer and the picked weights left unnormalized)
    "mixtral": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 20},
        "native stack",
    ),
    "qwen3moe": (
        "qwen3moe",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "mlp_only_layers": [0],
            "norm_topk_prob": False,
        },
        "native stack",
    ),
    # Gemma3ForConditionalGeneration: its text model, the vision tower left unread
    "gemma3-vision": (
        "gemma3-vision",
        {
            "head_dim": 32,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "native stack",
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, smollm_tokenizer):
    import transformers

    family, overrides, layers = CASES[request.param]
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), family, smollm_tokenizer, seed=7, **overrides
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run the whole budget, as ignore_eos does
    engine = Engine(model_path=str(path), max_total_tokens=4096, page_size=4, check_invariants=True)
    yield family, path, hf, engine, layers
    engine.shutdown()


def prompt(seed: int, n: int = 40) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def test_greedy_tokens_equal_transformers(case):
    family, _, hf, engine, layers = case
    ids = prompt(1)
    out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["output_ids"] == hf_greedy(hf, ids)
    stats = engine.stats()
    assert stats["model_family"] == family.removesuffix("-vision")
    assert stats["execution_layers"].startswith(layers)
    if layers == "native stack":  # and whole decode steps in one native call
        assert stats["execution_bursts"] == "native" and stats["total_burst_steps"] > 0


def test_prompt_logprobs_match_transformers(case):
    _, _, hf, engine, _ = case
    ids = prompt(2, 50)
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
    )
    ours = [entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]]
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    ref = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(ours), ref, atol=TOL, rtol=0)


def test_cached_batched_and_chunked_runs_equal_one_whole_run(case):
    _, path, _, engine, _ = case
    prompts = [prompt(10 + i, 30 + 7 * i) for i in range(3)]
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    again = engine.generate(
        input_ids=prompts[0] + [5, 6], sampling_params={**GREEDY, "max_new_tokens": 0}
    )
    assert again["meta_info"]["cached_tokens"] > 0
    cached = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert cached["meta_info"]["cached_tokens"] > 0 and cached["output_ids"] == alone[0]
    together = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in together] == alone
    with Engine(
        model_path=str(path), max_total_tokens=4096, page_size=4, chunked_prefill_size=8
    ) as chunked:
        assert [
            chunked.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts
        ] == alone


def sliding(case) -> int:
    family, path, _, engine, _ = case
    window = engine.core.args.sliding_window
    if window is None:
        pytest.skip(f"{family} has no sliding window here")
    return window


def test_sliding_layers_keep_about_a_window_of_pages(case):
    """Past the window, the sliding layers' pages go back as the request moves on: what stays is
    its window (and the one before the prompt's end), while the full layers keep every page."""
    window = sliding(case)
    _, _, hf, engine, _ = case
    engine.flush_cache()
    ids = prompt(20, 200)
    out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["output_ids"] == hf_greedy(hf, ids)
    stats = engine.stats()
    page = stats["page_size"]
    held = stats["kv_window_pages_total"] - stats["kv_window_pages_free"]
    slack = 32  # REWIND_SLACK_TOKENS
    assert held * page <= 2 * (window + slack + 2 * page)  # the end and the prompt's end
    tokens = len(ids) + NEW_TOKENS
    assert stats["kv_pages_cached"] == (tokens - 1) // page  # the full layers: all computed
    assert stats["kv_bytes_held"] < tokens * stats["kv_bytes_per_token"]


def test_a_prefix_whose_window_pages_are_gone_is_recomputed(case):
    """A request that shares only the start of a long cached sequence finds that start's window
    pages released: it reuses what its window can still read (here nothing) and computes the
    rest, with the tokens of an engine that never cached anything."""
    window = sliding(case)
    _, path, _, engine, _ = case
    engine.flush_cache()
    long = prompt(30, 200)
    engine.generate(input_ids=long, sampling_params=GREEDY)
    branch = long[:120] + prompt(31, 10)
    out = engine.generate(input_ids=branch, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] < 120 - window
    resent = long + prompt(32, 5)  # the same prompt and more: its window pages are kept
    again = engine.generate(input_ids=resent, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(long)
    with Engine(model_path=str(path), max_total_tokens=4096, page_size=4) as fresh:
        for ids, ours in ((branch, out), (resent, again)):
            assert (
                fresh.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
                == (ours["output_ids"])
            )


def test_multimodal_gemma3_names_map_to_its_text_model():
    """Both spellings of Gemma3ForConditionalGeneration's text weights; the vision tower and its
    projector are not read."""
    from plait.runtime.models.registry import family_named

    name = family_named("gemma3").hf_name
    for prefix in ("language_model.model.", "model.language_model."):
        assert (
            name(prefix + "layers.3.self_attn.q_norm.weight")
            == "model.layers.3.self_attn.q_norm.weight"
        )
    assert name("language_model.lm_head.weight") == "lm_head.weight"
    for skipped in (
        "vision_tower.encoder.layers.0.mlp.fc1.weight",
        "model.multi_modal_projector.mm_input_projection_weight",
    ):
        assert name(skipped) is None


def test_int8_quantizes_a_mixtures_experts_too(tmp_path, smollm_tokenizer):
    """`quantization="int8"` on a float checkpoint quantizes every expert's projections as it
    does the other linears (one quantized matrix per expert), and the prompt's logprobs stay
    those of the float model within int8's rounding."""
    _, overrides, _ = CASES["mixtral"]
    path = write_tiny_checkpoint(tmp_path, "mixtral", smollm_tokenizer, seed=7, **overrides)
    ids = prompt(3, 30)
    logprobs = []
    for quantization in (None, "int8"):
        with Engine(model_path=str(path), quantization=quantization, max_total_tokens=1024) as e:
            out = e.generate(
                input_ids=ids,
                sampling_params={"max_new_tokens": 1},
                return_logprob=True,
                logprob_start_len=0,
            )
            logprobs.append([x[0] for x in out["meta_info"]["input_token_logprobs"][1:]])
            types = e.stats()["weight_types"]
    experts = {k: v for by in types.values() for k, v in by.items() if "per expert" in k}
    # the checkpoint's tensors: gate, up and down of 4 experts in 2 layers
    assert experts == {"int8 quantized at load, per expert": 3 * 4 * 2}
    assert max(abs(a - b) for a, b in zip(*logprobs)) < 0.05
