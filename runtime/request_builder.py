"""Turning `generate`'s arguments into `Request`s: prompts tokenized, sampling parameters, ids,
timeouts and sizes checked against the model and the KV pool before anything is queued."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import torch

from plait.runtime import lifecycle
from plait.runtime.protocol import LogprobOptions, SamplingParams
from plait.runtime.request import Request, SamplingState

if TYPE_CHECKING:
    from plait.runtime.engine_core import EngineCore


def build_requests(
    core: EngineCore,
    text: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict | list[dict] | None,
    logprob: LogprobOptions,
    rid: str | list[str] | None,
    timeout: float | None = None,
    client_id: str | None = None,
) -> tuple[list[Request], bool]:
    """`generate`'s arguments as `Request`s, every shape and value checked (a `ValueError` that
    names the argument), and whether the caller gets a list back; `core`: the engine's, whose
    tokenizer, model shape and KV pool the prompts are checked against."""
    if (text is None) == (input_ids is None):
        raise ValueError("text, input_ids: pass exactly one of them")
    logprob.validate()
    timeout = lifecycle.check_timeout(timeout)
    # NOTE: every shape is checked before it is indexed or iterated: a JSON object or a number
    # where a list belongs is the caller's mistake (ValueError naming it), not a KeyError.
    source = "text" if text is not None else "input_ids"
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts:
            raise ValueError("text: the list of prompts is empty")
        wrong = [type(t).__name__ for t in texts if not isinstance(t, str)]
        if wrong:
            raise ValueError(f"text: expected a string or a list of strings, got {wrong[0]}")
        # NOTE: the batch call releases the GIL and spreads the texts over the cores.
        prompts = (
            core.tokenizer.encode_batch(texts)
            if len(texts) > 1
            else [core.tokenizer.encode(texts[0])]
        )
    else:
        if not isinstance(input_ids, list):
            raise ValueError(
                "input_ids: expected a list of token ids or a list of such lists, got "
                f"{type(input_ids).__name__}"
            )
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        for p in prompts:
            if not isinstance(p, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in p
            ):
                raise ValueError("input_ids: expected a list of integers or a list of such lists")
            bad = [t for t in p if not 0 <= t < core.args.vocab_size]
            if bad:
                raise ValueError(
                    f"input_ids: token id {bad[0]} is outside the vocabulary "
                    f"[0, {core.args.vocab_size})"
                )
    # NOTE: SamplingParams turns `stop` and `stop_token_ids` into lists before it checks them.
    for p in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        for name, item in (("stop", str), ("stop_token_ids", int)):
            value = p.get(name) if isinstance(p, dict) else None
            if value is not None and not isinstance(value, (item, list, tuple)):
                raise ValueError(
                    f"{name}: expected a {item.__name__} or a list of them, got {value!r:.80}"
                )
    if isinstance(sampling_params, list):
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts"
            )
        params = [SamplingParams.from_dict(p) for p in sampling_params]
    else:
        params = [SamplingParams.from_dict(sampling_params)] * len(prompts)
    vocab = core.args.vocab_size
    for sp in params:
        bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
    rids = rid if isinstance(rid, list) else [rid] * len(prompts)
    if len(rids) != len(prompts):
        raise ValueError(f"rid: got {len(rids)} ids for {len(prompts)} prompts")
    reqs: list[Request] = []
    for prompt, sp, r in zip(prompts, params, rids):
        if not prompt:
            raise ValueError(f"{source}: the prompt is empty (no tokens)")
        if len(prompt) >= core.context_len:
            raise ValueError(
                f"{source}: the prompt has {len(prompt)} tokens, but the model's context length is "
                f"{core.context_len} (prompt + output must fit)"
            )
        for i in range(sp.n):
            req_rid = r or uuid.uuid4().hex
            if sp.n > 1:
                req_rid = f"{req_rid}-{i}"
            req = Request(
                rid=req_rid,
                prompt_ids=list(prompt),
                sampling=SamplingState(params=sp, logprob=logprob),
                client_id=client_id or "",
            )
            if timeout is not None:
                req.deadline = req.arrival_time + timeout
            if sp.seed is not None:
                req.sampling.generator = torch.Generator(device=core.device).manual_seed(
                    sp.seed + i
                )
            core.scheduler.check_fits_pool(req)
            reqs.append(req)
    return reqs, batched or len(reqs) > 1
