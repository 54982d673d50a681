"""`deterministic=True` (batch-invariant inference): a request's prompt logprobs, output tokens and
output logprobs are the same to the bit alone and inside batches of 2 to 32 requests of other
lengths, with its prefill chunked beside theirs or its prefix found in the cache, on float32 and
quantized weights, with sliding and global layers and with experts; a seeded sample draws the same
tokens; a `select` scores the same alone and inside `run_batch`. The default mode
makes no such promise (its paths change with a step's rows)."""

from __future__ import annotations

import random

import pytest

from plait import Engine
from plait.kernels import native
from tests.conftest import write_tiny_checkpoint

SAMPLING = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(5, 160))] for _ in range(count)]


def _scored(out: dict) -> tuple:
    meta = out["meta_info"]
    return out["output_ids"], meta["input_token_logprobs"], meta["output_token_logprobs"]


CASES = {
    "llama-f32": ("llama", {}, {}),
    "llama-int4": ("llama", {}, {"quantization": "int4"}),
    # verification steps: a draft's rows are extend rows, scored as decode rows would be
    "llama-int4-ngram": (
        "llama",
        {},
        {"quantization": "int4", "speculative_algorithm": "ngram", "speculation": "always"},
    ),
    "qwen2-int8-kv8": ("qwen2", {}, {"quantization": "int8", "kv_cache_dtype": "int8"}),
    # sliding and global layers: two page spaces, each row's window its own
    "gemma3-int4": (
        "gemma3",
        {
            "head_dim": 32,
            "num_hidden_layers": 3,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        {"quantization": "int4"},
    ),
    # experts run over the tokens that picked them: more rows in a batch, the same per row
    "qwen3moe-int4": (
        "qwen3moe",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
        {"quantization": "int4"},
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def deterministic_engine(request, tmp_path_factory, smollm_tokenizer):
    arch, shapes, kwargs = CASES[request.param]
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), arch, smollm_tokenizer, seed=4, **shapes
    )
    engine = Engine(
        model_path=str(path),
        deterministic=True,
        max_total_tokens=16384,
        page_size=4,
        chunked_prefill_size=64,
        check_invariants=True,
        **kwargs,
    )
    assert engine.stats()["execution_batch_invariant"] == "on"
    yield engine
    engine.shutdown()


def test_a_requests_logprobs_do_not_depend_on_its_batch(deterministic_engine) -> None:
    engine = deterministic_engine
    prompts = _prompts(32, engine.args.vocab_size)
    target = prompts[0]

    def run(batch: list[list[int]]) -> tuple:
        outs = engine.generate(
            input_ids=batch,
            sampling_params=[SAMPLING] * len(batch),
            return_logprob=True,
            logprob_start_len=0,
        )
        return _scored(outs[batch.index(target)])

    engine.flush_cache()
    alone = run([target])
    assert len(alone[1]) == len(target) and len(alone[2]) == SAMPLING["max_new_tokens"]
    for size in (2, 8, 32):
        engine.flush_cache()  # the target's prefill runs inside the batch's steps
        assert run(prompts[:size]) == alone, f"in a batch of {size}"
    # found in the cache, decoded beside requests that arrive in another order
    assert run(prompts[8:16][::-1] + [target]) == alone
    assert engine.stats()["kv_pages_in_use"] == 0


def test_a_seeded_sample_does_not_depend_on_its_batch(deterministic_engine) -> None:
    # no logprobs asked: decode steps run in bursts, drawn by the native sampler
    engine = deterministic_engine
    prompts = _prompts(16, engine.args.vocab_size, seed=1)
    params = [
        {"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": i} for i in range(16)
    ]
    alone = engine.generate(input_ids=prompts[0], sampling_params=params[0])["output_ids"]
    for size in (4, 16):
        engine.flush_cache()
        outs = engine.generate(input_ids=prompts[:size], sampling_params=params[:size])
        assert outs[0]["output_ids"] == alone, f"in a batch of {size}"
    assert engine.stats()["total_burst_steps"] > 0


def test_deterministic_speculation_is_not_left_to_timing() -> None:
    from plait.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="deterministic: .*speculation to 'always' or 'never'"):
        EngineConfig.from_kwargs(deterministic=True, speculative_algorithm="ngram")
    config = EngineConfig.from_kwargs(
        deterministic=True, speculative_algorithm="ngram", speculation="always"
    )
    assert config.deterministic and config.speculation == "always"


def test_the_serve_flag_and_sglangs_spelling_set_it() -> None:
    from plait.runtime.config_flags import Parser, add_engine_args, engine_config

    parser = Parser(prog="plait serve")
    add_engine_args(parser)
    for flag in ("--deterministic", "--enable-deterministic-inference"):
        assert engine_config(parser.parse_args([flag])).deterministic
    assert not engine_config(parser.parse_args([])).deterministic


def test_deterministic_needs_the_native_stack(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.setattr(native, "DISABLED", True)
    with pytest.raises(ValueError, match="deterministic: .*native CPU decode stack"):
        Engine(model_path=str(tiny_llama_dir), deterministic=True, max_total_tokens=1024)


def test_select_scores_the_same_alone_and_in_run_batch() -> None:
    from plait import Runtime, assistant, program, select, system, user

    @program
    def sentiment(s, review):
        s += system("Say whether each movie review is positive or negative.")
        s += user(review)
        s += assistant("It is" + select("label", [" positive", " negative", " mixed"]))

    reviews = [
        "A wonderful, moving film.",
        "Dull and far too long.",
        "I laughed, I cried.",
        "Meh.",
        "The actors seemed bored.",
        "Best of the year.",
        "Not bad, not good.",
        "Gorgeous photography, confusing plot.",
    ]
    runtime = Runtime(deterministic=True, max_total_tokens=8192)
    try:
        alone = [
            sentiment.run(review=r, backend=runtime).get_meta_info("label")["scores"]
            for r in reviews
        ]
        batch = sentiment.run_batch([{"review": r} for r in reviews], backend=runtime)
        assert [s.get_meta_info("label")["scores"] for s in batch] == alone
    finally:
        runtime.shutdown()
