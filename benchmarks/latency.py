"""`plait bench latency`: prefill and single-stream decode speed, plait beside transformers.

Same model, same dtype, same process, one after the other; ratios are plait / transformers.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

import torch

from plait.benchmarks.common import best_of, print_table, write_json

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _prompt_ids(tokenizer: Any, n: int) -> list[int]:
    text = (
        "The history of computing is a story of layers: each generation of machines hides the "
        "details of the one below it, and every abstraction costs a little speed. "
    )
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text)
    return ids[:n]


def measure_plait(model_path: str | None, dtype: str, prompt_len: int, decode_len: int, repeats: int) -> dict:
    from plait.runtime.engine import Engine

    engine = Engine(model_path=model_path, dtype=dtype, max_total_tokens=prompt_len + decode_len + 64)
    try:
        ids = _prompt_ids(engine.tokenizer, prompt_len)
        prefill_only = {"max_new_tokens": 0}
        engine.generate(input_ids=ids[:32], sampling_params={"max_new_tokens": 2})  # warm up

        def prefill_once() -> None:
            engine.flush_cache()  # a cached prompt would skip the very prefill being timed
            engine.generate(input_ids=ids, sampling_params=prefill_only)

        prefill_s = best_of(prefill_once, repeats)
        decode_params = {"max_new_tokens": decode_len, "temperature": 0, "ignore_eos": True}

        def decode_once() -> float:
            first = None
            for _ in engine.generate(input_ids=ids[:16], sampling_params=decode_params, stream=True):
                if first is None:
                    first = time.perf_counter()
            return (decode_len - 1) / (time.perf_counter() - first)

        decode_tps = max(decode_once() for _ in range(repeats))
    finally:
        engine.shutdown()
    return {"prefill_tok_s": prompt_len / prefill_s, "decode_tok_s": decode_tps}


def measure_transformers(model_path: str | None, dtype: str, prompt_len: int, decode_len: int, repeats: int) -> dict:
    import transformers

    from plait.runtime.model_loader.locate import locate_checkpoint
    from plait.runtime.tokenizer import Tokenizer

    loc = locate_checkpoint(model_path)
    if loc.kind == "gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(loc.path), gguf_file=os.path.basename(loc.path), dtype=torch.float32
        )
        import gguf

        from plait.runtime.model_loader.gguf_loader import read_metadata

        tokenizer = Tokenizer.from_gguf_metadata(read_metadata(gguf.GGUFReader(loc.path)))
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
        kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(short))
        one = best_of(lambda: model.generate(short, max_new_tokens=1, min_new_tokens=1, **kwargs), repeats)
        full = best_of(
            lambda: model.generate(short, max_new_tokens=decode_len, min_new_tokens=decode_len, **kwargs),
            repeats,
        )
    gc.collect()
    return {"prefill_tok_s": prompt_len / prefill_s, "decode_tok_s": (decode_len - 1) / (full - one)}


def run_latency_bench(args: argparse.Namespace) -> int:
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in _DTYPES:
            raise SystemExit(f"--dtypes: unknown dtype {d!r} (choose from {', '.join(_DTYPES)})")
    repeats = getattr(args, "repeats", 3)
    results: dict[str, dict[str, Any]] = {}
    rows = []
    for dtype in dtypes:
        ours = measure_plait(args.model_path, dtype, args.prompt_len, args.decode_len, repeats)
        ref = (
            measure_transformers(args.model_path, dtype, args.prompt_len, args.decode_len, repeats)
            if args.transformers
            else None
        )
        results[dtype] = {"plait": ours, "transformers": ref}
        for metric, label in (("prefill_tok_s", f"prefill tok/s ({args.prompt_len})"),
                              ("decode_tok_s", f"decode tok/s ({args.decode_len})")):
            theirs = ref[metric] if ref else None
            rows.append([dtype, label, ours[metric], theirs, ours[metric] / theirs if theirs else None])
    print()
    print_table(["dtype", "metric", "plait", "transformers", "ratio"], rows)
    write_json(
        args.output,
        {"benchmark": "latency", "prompt_len": args.prompt_len, "decode_len": args.decode_len,
         "torch_threads": torch.get_num_threads(), "results": results},
    )
    return 0
