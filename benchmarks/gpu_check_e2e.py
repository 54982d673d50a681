"""End-to-end part of the device check (`gpu_check.py`): decode throughput on the default model and
a random-weight 1B-class Llama with CUDA graphs on and off, and greedy outputs with the Triton
kernels against the torch references. `sz` is `gpu_check.Sizes` (the GPU run or the CPU dry run).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

# HOOK (CUDA graphs on vs off): the Engine keyword that switches decode CUDA graphs. Until the
# engine accepts it, the "graphs on" runs report the engine's error and only "off" is measured.
ENGINE_GRAPH_KWARG = "cuda_graphs"
LLAMA_1B = dict(  # Llama-3.2-1B shapes, SmolLM2's vocabulary
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


def write_random_llama(sz: Any, path: Path) -> Path:
    """A random-weight Llama checkpoint (1B-class on the GPU) with the default model's tokenizer."""
    from plait.runtime.model_loader.gguf_file import read_gguf_metadata
    from plait.runtime.model_loader.locate import default_model_path
    from plait.runtime.thirdparty import import_transformers
    from plait.runtime.tokenizer import Tokenizer

    transformers = import_transformers()
    tokenizer = Tokenizer.from_gguf_metadata(read_gguf_metadata(default_model_path()))
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, bos_token_id=1, eos_token_id=2, **sz.llama
    )
    torch.manual_seed(0)
    with torch.device(sz.device):
        model = transformers.LlamaForCausalLM(config).to(
            torch.bfloat16 if sz.device == "cuda" else torch.float32
        )
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "add_bos_token": False})
    )
    return path


def decode_throughput(sz: Any, model_path: str | None, **engine_kwargs: Any) -> dict[str, Any]:
    from plait.runtime.engine import Engine

    start = time.perf_counter()
    engine = Engine(model_path, device=sz.device, page_size=16, **engine_kwargs)
    startup = time.perf_counter() - start
    try:
        rng = random.Random(0)
        prompts = [
            [rng.randrange(100, 40000) for _ in range(rng.randint(32, 128))]
            for _ in range(sz.e2e_requests)
        ]
        params = {"max_new_tokens": sz.e2e_new_tokens, "temperature": 0, "ignore_eos": True}
        engine.generate(
            input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4}
        )  # warm up
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    generated = sum(len(o["output_ids"]) for o in outs)
    return {"startup_s": startup, "seconds": elapsed, "tok/s": generated / elapsed}


def e2e_rows(sz: Any, tmp: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    models: list[tuple[str, str | None]] = [("smollm2-135M (default)", None)]
    try:
        models.append(
            (
                "llama random " + str(sz.llama["hidden_size"]),
                str(write_random_llama(sz, tmp / "llama")),
            )
        )
    except Exception as exc:  # noqa: BLE001 - the check reports and goes on
        rows.append({"model": "llama random", "error": repr(exc)[:300]})
    for name, path in models:
        measured: dict[bool, float] = {}
        for graphs in (False, True):
            # HOOK: CUDA graphs on vs off through the engine keyword ENGINE_GRAPH_KWARG
            entry: dict[str, Any] = {"model": name, "cuda_graphs": graphs}
            try:
                entry.update(decode_throughput(sz, path, **{ENGINE_GRAPH_KWARG: graphs}))
                measured[graphs] = entry["tok/s"]
            except TypeError as exc:  # the engine does not take the keyword yet
                entry["error"] = f"Engine rejects {ENGINE_GRAPH_KWARG}=: {str(exc)[:40]}..."
                if not graphs:
                    entry.update(decode_throughput(sz, path), cuda_graphs="engine default")
            rows.append(entry)
        if len(measured) == 2:
            rows[-1]["speedup"] = measured[True] / measured[False]
    return rows


def greedy_agreement(sz: Any) -> dict[str, Any]:
    """Greedy outputs with the Triton kernels against the torch references, default model,
    float32."""
    from plait import environment
    from plait.kernels.dispatch import DISABLE_TRITON_ENV
    from plait.runtime.engine import Engine

    words = ["cat", "robot", "river", "teacher", "dragon", "baker", "pilot", "tree"]
    texts = [f"Write a short story about a {w} who learns to code." for w in words][
        : sz.agreement_prompts
    ]
    params = {"max_new_tokens": sz.agreement_tokens, "temperature": 0}
    results = {}
    try:
        for label, disabled in (("triton", "0"), ("reference", "1")):
            os.environ[DISABLE_TRITON_ENV] = disabled
            environment.reload()
            engine = Engine(device=sz.device, dtype="float32", page_size=16)
            try:
                results[label] = [
                    o["output_ids"] for o in engine.generate(texts, sampling_params=params)
                ]
            finally:
                engine.shutdown()
    finally:
        os.environ.pop(DISABLE_TRITON_ENV, None)
        environment.reload()
    prefixes = []
    for a, b in zip(results["triton"], results["reference"]):
        prefixes.append(
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        )
    identical = sum(a == b for a, b in zip(results["triton"], results["reference"]))
    return {"prompts": len(texts), "identical": identical, "common_prefix_tokens": prefixes}
