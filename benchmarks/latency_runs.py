"""One format's runs of `plait bench latency` on each system: plait's prefill, decode (greedy and
sampled) and perplexity (`measure_plait`), transformers' prefill and decode on the same weights in
the float dtypes (`measure_transformers`), and llama-cpp-python's on the GGUF file itself with the
same thread count (`measure_llama_cpp`); and the formats a run takes, with the engine settings
each stands for (`_format_kwargs`).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch

from plait.benchmarks.common import best_of, check_decoded
from plait.benchmarks.roofline import measure_weights_read

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FORMATS = ("float32", "bfloat16", "native", "int8", "int4", "deterministic")

PERPLEXITY_TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, and for ninety years its keepers "
    "had climbed the same hundred and twelve steps each evening to light the lamp. The last "
    "keeper, a quiet woman who had come to the island as a child, kept a logbook in which she "
    "wrote the weather, the ships that passed, and the birds that rested on the gallery rail. When "
    "the light was automated, she stayed on as a caretaker, painting the iron railings every "
    "spring and answering letters from people who remembered the sound of the foghorn. Scientists "
    "later used her logbooks to study how the migration of seabirds had shifted as the winters "
    "grew milder."
)


def _format_kwargs(fmt: str) -> dict:
    if fmt in ("int8", "int4"):
        return {"dtype": "float32", "quantization": fmt}
    if fmt == "native":  # the default: a GGUF's blocks as stored, the rest float32
        return {"dtype": "float32"}
    if fmt == "deterministic":  # the same weights, every step batch-invariant
        return {"dtype": "float32", "deterministic": True}
    return {"dtype": fmt, "quantization": "float32"}  # every block dequantized


# the sampled decode row: a typical chat setting, seeded
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "seed": 0}


def _prompt_ids(tokenizer: Any, n: int) -> list[int]:
    text = (
        "The history of computing is a story of layers: each generation of machines hides the "
        "details of the one below it, and every abstraction costs a little speed. "
    )
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text)
    return ids[:n]


def measure_plait(
    model_path: str | None,
    fmt: str,
    prompt_len: int,
    decode_len: int,
    repeats: int,
    kv_cache_dtype: str = "auto",
    engine_args: dict | None = None,
) -> dict:
    """`engine_args`: the command's engine flags (`--cpu-threads`, `--page-size`, ...); the model,
    the format's dtype and quantization, the KV cache's dtype and the pool size are the bench's."""
    from plait.runtime.engine import Engine

    engine = Engine(
        **{
            **(engine_args or {}),
            "model_path": model_path,
            "max_total_tokens": max(prompt_len + decode_len + 64, 1024),
            "kv_cache_dtype": kv_cache_dtype,
            **_format_kwargs(fmt),
        }
    )
    try:
        ids = _prompt_ids(engine.tokenizer, prompt_len)
        prefill_only = {"max_new_tokens": 0}
        engine.generate(input_ids=ids[:32], sampling_params={"max_new_tokens": 2})  # warm up

        def prefill_once() -> None:
            engine.flush_cache()  # a cached prompt would skip the very prefill being timed
            engine.generate(input_ids=ids, sampling_params=prefill_only)

        prefill_s = best_of(prefill_once, repeats)
        decode_params = {"max_new_tokens": decode_len, "temperature": 0, "ignore_eos": True}

        def decode_once(params: dict = decode_params) -> float:
            first = last = None
            for chunk in engine.generate(input_ids=ids[:16], sampling_params=params, stream=True):
                last = chunk
                if first is None:
                    first = time.perf_counter()
            elapsed = time.perf_counter() - first
            check_decoded(last, decode_len)
            return (decode_len - 1) / elapsed

        # NOTE: a virtual machine's memory reads can drift by tens of percent within seconds, so
        # each decode run is paired with reads of the weights just before and after it, and its
        # share of the roofline is taken against the faster of the two.
        # The sampled runs alternate with the greedy ones, so that both see the same memory phases.
        decode_runs, read_runs, sampled_runs = [], [], []
        for _ in range(repeats):
            before = measure_weights_read(engine, 2)
            decode_runs.append(decode_once())
            after = measure_weights_read(engine, 2)
            read_runs.append(min(before, after) if before and after else None)
            sampled_runs.append(decode_once({**decode_params, **SAMPLED}))
        decode_tps, sampled_tps = max(decode_runs), max(sampled_runs)
        paired = sorted(tps * read_s for tps, read_s in zip(decode_runs, read_runs) if read_s)
        decode_share = paired[len(paired) // 2] if paired else None
        text_ids = engine.tokenizer.encode(PERPLEXITY_TEXT)
        half = len(text_ids) // 2
        engine.flush_cache()
        engine.generate(
            input_ids=text_ids[:half], sampling_params={"max_new_tokens": 0}
        )  # now cached
        out = engine.generate(
            input_ids=text_ids,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=half,
        )
        logprobs = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
        perplexity = float(torch.tensor(logprobs).neg().mean().exp())
        linear_params = sum(
            m.in_features * m.out_features
            for name, m in engine.core.model.named_modules()
            if hasattr(m, "in_features") and name != "lm_head"
        )
        stats = engine.stats()
        weight_bytes = stats["weight_bytes"]
        # what the engine chose at start: the paths these figures are of
        execution = {k.removeprefix("execution_"): v for k, v in stats.items() if "execution_" in k}
        reads = sorted(r for r in read_runs if r)
        weights_read_s = reads[len(reads) // 2] if reads else None
        a = engine.args  # causal attention: QK^T and PV over half the T x T scores, every head
        attention_flops = 2 * a.num_layers * a.num_heads * a.head_dim * prompt_len * prompt_len
    finally:
        engine.shutdown()
    return {
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": decode_tps,
        "sampled_decode_tok_s": sampled_tps,
        "weight_bytes": weight_bytes,
        "weights_read_s": weights_read_s,
        "decode_share_of_roofline": decode_share,
        "perplexity": perplexity,
        "prefill_flops_per_token": 2 * linear_params + attention_flops // prompt_len,
        "execution": execution,
    }


def measure_transformers(
    model_path: str | None, dtype: str, prompt_len: int, decode_len: int, repeats: int
) -> dict:
    from plait.runtime.thirdparty import import_transformers

    transformers = import_transformers()

    from plait.runtime.model_loader.locate import locate_checkpoint
    from plait.runtime.tokenizer import Tokenizer

    loc = locate_checkpoint(model_path)
    if loc.kind == "gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(loc.path), gguf_file=os.path.basename(loc.path), dtype=torch.float32
        )
        from plait.runtime.model_loader.gguf_file import read_gguf_metadata

        tokenizer = Tokenizer.from_gguf_metadata(read_gguf_metadata(loc.path))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(loc.path, dtype=torch.float32)
        tokenizer = Tokenizer.from_hf_dir(loc.path)
    model = model.to(_DTYPES[dtype]).eval()
    ids = torch.tensor([_prompt_ids(tokenizer, prompt_len)])
    short = ids[:, :16]
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model(ids[:, :32])
        prefill_s = best_of(lambda: model(ids, attention_mask=mask, use_cache=True), repeats)
        kwargs = dict(
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            attention_mask=torch.ones_like(short),
        )
        one = best_of(
            lambda: model.generate(short, max_new_tokens=1, min_new_tokens=1, **kwargs), repeats
        )
        full = best_of(
            lambda: model.generate(
                short, max_new_tokens=decode_len, min_new_tokens=decode_len, **kwargs
            ),
            repeats,
        )
    gc.collect()
    return {
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": (decode_len - 1) / (full - one),
    }


def measure_llama_cpp(
    model_path: str | None, prompt_len: int, decode_len: int, repeats: int
) -> dict | None:
    """llama-cpp-python on the same GGUF file and thread count, or None when not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from plait.runtime.model_loader.locate import locate_checkpoint

    loc = locate_checkpoint(model_path)
    if loc.kind != "gguf":
        return None
    from plait.benchmarks.llama_cpp import keep_llama_cpp_off_amx

    keep_llama_cpp_off_amx()
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(
        loc.path,
        n_ctx=prompt_len + decode_len + 64,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=prompt_len,
        verbose=False,
    )
    ids = llm.tokenize(PERPLEXITY_TEXT.encode())
    ids = (ids * (prompt_len // len(ids) + 1))[:prompt_len]

    def prefill_once() -> None:
        llm.reset()
        llm.eval(ids)

    prefill_s = best_of(prefill_once, repeats)

    def decode_once() -> float:
        llm.reset()
        llm.eval(ids[:16])
        start = time.perf_counter()
        for _ in range(decode_len):
            token = llm.sample(temp=0.0)
            llm.eval([token])
        return decode_len / (time.perf_counter() - start)

    decode_tps = max(decode_once() for _ in range(repeats))
    return {
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": decode_tps,
        "version": llama_cpp.__version__,
    }
