"""The native decode stack (`runtime/models/native_decode.py`) computes what the layer-by-layer
path computes: float32 and quantized tiny Llama / Qwen2 (qkv bias) / Mistral (sliding window) /
Qwen3 (q/k norms) / Gemma 3 (sliding and global layers) / mixture-of-experts engines with
float32, bfloat16 and int8 KV caches, with and without speculative decoding (short extends), give
the same tokens and logprobs with the stack on and off."""

from __future__ import annotations

import pytest
import torch

from plait import Engine
from plait.kernels import decode_stack
from plait.runtime.execution import Execution, Layers
from plait.runtime.models import native_decode
from tests.conftest import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    not decode_stack.available(), reason="native CPU kernels did not build"
)

CASES = {
    "llama-f32": ("llama", {}, {}),
    "llama-f32-tied-ngram": (
        "llama",
        {"tie_word_embeddings": True},
        {"speculative_algorithm": "ngram"},
    ),
    "llama-int4": ("llama", {}, {"quantization": "int4"}),
    "qwen2-int8-kv8": (
        "qwen2",
        {},
        {"quantization": "int8", "kv_cache_dtype": "int8", "page_size": 4},
    ),
    "mistral-int4-kvbf16": (
        "mistral",
        {"sliding_window": 16},
        {"quantization": "int4", "kv_cache_dtype": "bfloat16"},
    ),
    "qwen3-int8": ("qwen3", {"head_dim": 16}, {"quantization": "int8"}),
    # Gemma 3: sliding and global layers (two page spaces, two rotary bases), GELU-tanh, four
    # norms a layer, q/k norms, scaled embeddings read from the tied head's blocks
    "gemma3-int4-tied": (
        "gemma3",
        {
            "head_dim": 32,
            "num_hidden_layers": 3,
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        {"quantization": "int4", "page_size": 4},
    ),
    # mixtures of experts: 4 experts, 2 per token, quantized per expert (Qwen3-MoE with a dense
    # first layer)
    "mixtral-int8": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 20},
        {"quantization": "int8"},
    ),
    "qwen3moe-int4": (
        "qwen3moe",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "mlp_only_layers": [0],
        },
        {"quantization": "int4"},
    ),
    "llama-int4-ngram": ("llama", {}, {"quantization": "int4", "speculative_algorithm": "ngram"}),
    "llama-int8-self": (
        "llama",
        {"num_hidden_layers": 3},
        {"quantization": "int8", "speculative_algorithm": "self", "draft_layers": 1},
    ),
}
PROMPTS = [
    [5, 17, 300, 4000, 12, 9, 81] * 3,
    list(range(40, 90)),
    [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],
]


@pytest.fixture(scope="module", params=list(CASES))
def engine(request, tmp_path_factory, smollm_tokenizer):
    arch, shapes, kwargs = CASES[request.param]
    if "speculative_algorithm" in kwargs:
        # NOTE: speculation always on, not measured: which steps draft decides how many rows each
        # matmul gets, and decode rows (at most 4) round activations to int8 where taller
        # batches do not.
        kwargs = {**kwargs, "speculation": "always"}
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), arch, smollm_tokenizer, seed=2, **shapes
    )
    with Engine(
        model_path=str(path), max_total_tokens=4096, check_invariants=True, **kwargs
    ) as made:
        yield made


def outputs(engine: Engine) -> list[tuple[list[int], list[float]]]:
    engine.flush_cache()
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True)
    return [
        (o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs
    ]


# the logprobs' tolerance: the same kernels on both paths, but a mixture's router softmax is
# torch's on one and the library's on the other, and a last-bit difference in a token's weights
# can move the int8 rounding of the activations after it
MIXTURE_TOL = 5e-4


def test_stack_matches_layer_by_layer(engine, monkeypatch):
    calls = []
    real = native_decode.NativeDecodeStack.run
    monkeypatch.setattr(
        native_decode.NativeDecodeStack, "run", lambda *a: calls.append(1) or real(*a)
    )
    fused = outputs(engine)
    assert calls, "the native stack never ran"
    monkeypatch.setattr(Execution, "layers_for", lambda self, *a: Layers.LAYERWISE)
    plain = outputs(engine)
    for (ids_a, lp_a), (ids_b, lp_b) in zip(fused, plain):
        assert ids_a == ids_b
        tol = MIXTURE_TOL if engine.core.args.num_experts else 1e-4
        assert max(abs(a - b) for a, b in zip(lp_a, lp_b)) < tol


def test_bfloat16_models_keep_the_layer_path(tiny_llama_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(native_decode.NativeDecodeStack, "run", lambda *a: calls.append(1))
    with Engine(model_path=str(tiny_llama_dir), dtype="bfloat16", max_total_tokens=512) as engine:
        out = engine.generate(
            input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 4, "ignore_eos": True}
        )
    assert len(out["output_ids"]) == 4 and not calls


def test_a_slot_outside_the_pool_raises_before_any_layer_runs():
    from plait.kernels.attention_cpu import CpuRows

    shape = decode_stack.DecodeShape(2, 8, 2, 1, 4, 16, 1e-5, 0.5, 0, 0)
    layer = decode_stack.DecodeLayer()
    layer.num_slots = 10  # a pool of 10 slots
    one = torch.zeros(1, dtype=torch.long)
    rows = CpuRows(torch.zeros(1, 4, dtype=torch.long), one, one, one, one + 1, frozenset())
    x = torch.randn(2, 8)
    before = x.clone()
    with pytest.raises(IndexError, match=r"slots\[1\] = 10 is outside the KV pool's 10 slots"):
        decode_stack.run_layers(
            (decode_stack.DecodeLayer * 1)(layer),
            1,
            shape,
            [rows],
            torch.zeros(2, dtype=torch.long),
            torch.tensor([[9, 10]]),
            x,
            torch.empty(2, 8),
            False,
            torch.empty(decode_stack.scratch_floats(2, shape)),
        )
    assert torch.equal(x, before)
