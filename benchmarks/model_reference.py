"""What `plait bench latency` measures per model besides speed: the KV cache a long context holds
(both pools, against what full attention would hold), and how far llama.cpp's log-probabilities
of a text are from plait's on the same GGUF file (teacher-forced, the same token ids).
"""

from __future__ import annotations

import statistics
from typing import Any

AGREEMENT_TEXT = (
    "The harbour town woke slowly in winter. Before dawn the bakers lit their ovens, and the smell "
    "of bread drifted down the steep lanes to the quay, where the fishermen were already checking "
    "their nets by lantern light. The ferry to the mainland left at seven, and on most mornings it "
    "carried a handful of students, a nurse who worked at the county hospital, and crates of "
    "smoked fish packed in ice. In the afternoons the wind rose and the sea turned grey and "
    "restless; the children walked home from school with their collars turned up, counting the "
    "gulls that sheltered on the harbour wall. The town had a library of two rooms, a church whose "
    "bell had cracked in a storm a century ago and was never recast, and a museum of shipwrecks "
    "kept by a retired teacher who could name every vessel lost on the reef since records began. "
    "Visitors came in summer for the cliffs and the seals, but it was in winter, people said, that "
    "the place showed what it was: a small community that had learned to live with the sea."
)


def measure_kv(model_path: str | None, engine_kwargs: dict, context: int) -> dict[str, Any]:
    """KV bytes per token of a `context`-token prompt (prefilled, one token generated): what the
    engine holds (`kv_bytes_held`, both pools) against what full attention would hold."""
    from plait.runtime.engine import Engine

    with Engine(model_path=model_path, **engine_kwargs) as engine:
        context = min(context, engine.context_len - 1)
        engine.generate(
            input_ids=_ids(engine.tokenizer, context), sampling_params={"max_new_tokens": 1}
        )
        stats = engine.stats()
    held = stats["kv_bytes_held"] / context
    full = stats["kv_bytes_per_token"]
    return {
        "context": context,
        "held_bytes_per_token": held,
        "full_attention_bytes_per_token": full,
        "share_of_full_attention": held / full,
    }


def plait_teacher_forced(engine: Any, ids: list[int]) -> tuple[list[int], list[float]]:
    """plait's top token and the log-probability of the next token of `ids`, at each position."""
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=1,
    )
    meta = out["meta_info"]
    top = [e[0][1] for e in meta["input_top_logprobs"][1:]]
    return top, [e[0] for e in meta["input_token_logprobs"][1:]]


def llama_cpp_teacher_forced(
    path: str, ids: list[int], threads: int
) -> tuple[list[int], list[float]] | None:
    """The same from llama-cpp-python on the GGUF file, fed the same ids; None if not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    import numpy as np

    from plait.benchmarks.llama_cpp import keep_llama_cpp_off_amx

    keep_llama_cpp_off_amx()
    llm = llama_cpp.Llama(
        path,
        n_ctx=len(ids) + 8,
        n_batch=len(ids),
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
    )
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # [n - 1, vocab]
    logits -= logits.max(-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    chosen = logprobs[np.arange(len(ids) - 1), ids[1:]]
    return logprobs.argmax(-1).tolist(), chosen.tolist()


def agreement(ours: tuple[list[int], list[float]], theirs: tuple[list[int], list[float]]) -> dict:
    """Top-1 agreement and |Δ log-probability| of the text's tokens (median and max)."""
    deltas = [abs(a - b) for a, b in zip(ours[1], theirs[1])]
    same = sum(a == b for a, b in zip(ours[0], theirs[0])) / len(deltas)
    return {
        "positions": len(deltas),
        "top1_agreement": same,
        "median_abs_logprob_delta": statistics.median(deltas),
        "max_abs_logprob_delta": max(deltas),
    }


def llama_cpp_agreement(model_path: str | None, engine_kwargs: dict, threads: int) -> dict | None:
    """plait (with `engine_kwargs`) against llama.cpp on the same GGUF, teacher-forced over
    `AGREEMENT_TEXT`; None where llama.cpp is not installed or the model is not a GGUF file."""
    from plait.runtime.engine import Engine
    from plait.runtime.model_loader.locate import locate_checkpoint

    location = locate_checkpoint(model_path)
    if location.kind != "gguf":
        return None
    with Engine(model_path=model_path, **engine_kwargs) as engine:
        ids = engine.tokenizer.encode(AGREEMENT_TEXT)
        ours = plait_teacher_forced(engine, ids)
    theirs = llama_cpp_teacher_forced(location.path, ids, threads)
    return None if theirs is None else agreement(ours, theirs)


def _ids(tokenizer: Any, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(AGREEMENT_TEXT, add_special_tokens=not ids)
    return ids[:n]
