"""Continuous decode steps (`num_continuous_decode_steps`): greedy and sampled decodes run several
whole steps per native call (`kernels/decode_stack.py: run_burst`) and give exactly the tokens,
text and finish reasons of one step at a time (sampled ones with a seed), across model families,
weight formats, KV dtypes, page sizes and a sliding window, with page accounting checked after
every step. A stop token ends a burst early; a message posted to the engine ends it after the
current step."""

from __future__ import annotations

import ctypes

import pytest
import torch

from plait import Engine
from plait.kernels import decode_stack
from plait.runtime.decode_burst import BurstRunner
from tests.conftest import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    not decode_stack.burst_available(), reason="native CPU kernels did not build"
)

CASES = {
    "llama-f32-tied": ("llama", {"tie_word_embeddings": True}, {}),
    "llama-int4": ("llama", {}, {"quantization": "int4"}),
    "qwen2-int8-kv8-pages": (
        "qwen2",
        {},
        {"quantization": "int8", "kv_cache_dtype": "int8", "page_size": 4},
    ),
    "mistral-int4-kvbf16": (
        "mistral",
        {"sliding_window": 16},
        {"quantization": "int4", "kv_cache_dtype": "bfloat16"},
    ),
}
PROMPTS = [
    [5, 17, 300, 4000, 12, 9, 81] * 3,
    list(range(40, 90)),
    [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],
]
MAX_NEW = [40, 13, 27]  # bursts shrink to the tokens a request has left


def _pool_is_whole(engine: Engine) -> bool:
    stats = engine.stats()
    return stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, tmp_path_factory, smollm_tokenizer):
    arch, shapes, kwargs = CASES[request.param]
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), arch, smollm_tokenizer, seed=2, **shapes
    )
    common = dict(model_path=str(path), max_total_tokens=4096, check_invariants=True, **kwargs)
    with Engine(num_continuous_decode_steps=1, **common) as single, Engine(**common) as burst:
        yield single, burst


@pytest.fixture
def bursts(monkeypatch):
    """The tokens each row got from each burst."""
    seen: list[list[list[int]]] = []
    real = BurstRunner.run

    def record(self, batch, steps, interrupt=None):
        results = real(self, batch, steps, interrupt)
        seen.append([r.tokens for r in results])
        return results

    monkeypatch.setattr(BurstRunner, "run", record)
    return seen


def _run(engine: Engine, prompts, params) -> list[tuple[list[int], str, dict]]:
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in outs]


def test_bursts_give_the_tokens_of_single_steps(engines, bursts):
    single, burst = engines
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in MAX_NEW]
    expected = _run(single, PROMPTS, params)
    assert not bursts, "num_continuous_decode_steps=1 must not burst"
    got = _run(burst, PROMPTS, params)
    assert got == expected
    assert bursts and 1 < max(len(row) for b in bursts for row in b) <= 16, bursts
    assert [len(ids) for ids, _, _ in got] == MAX_NEW
    assert sum(len(row) for b in bursts for row in b) <= sum(MAX_NEW), (
        "a burst ran past a request's last token"
    )
    assert _pool_is_whole(burst)


def test_stop_tokens_and_strings_end_requests_inside_a_burst(engines, bursts):
    single, burst = engines
    reference = _run(
        single, PROMPTS[:1], {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    )[0]
    ids, text = reference[0], reference[1]
    # the first token that appears once, late enough to fall inside a burst
    index = next(i for i in range(6, 40) if ids.index(ids[i]) == i)
    by_token = {
        "max_new_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "stop_token_ids": [ids[index]],
    }
    assert _run(single, PROMPTS[:1], by_token) == _run(burst, PROMPTS[:1], by_token)
    got = _run(burst, PROMPTS[:1], by_token)[0]
    assert got[0] == ids[: index + 1] and got[2]["matched"] == ids[index]
    assert bursts[-1][0][-1] == ids[index], "the burst went on past every row's stop token"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        by_string = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop]}
        assert _run(single, PROMPTS[:1], by_string) == _run(burst, PROMPTS[:1], by_string)
    assert _pool_is_whole(burst)


def test_streams_get_each_token_and_add_up_to_the_text(engines):
    single, burst = engines
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    expected = _run(single, [PROMPTS[2]], [params])[0]
    # bursts whose tokens are handed on between their steps: the same tokens and text
    steps = burst.stats()["total_burst_steps"]
    chunks = list(burst.generate(input_ids=PROMPTS[2], sampling_params=params, stream=True))
    assert burst.stats()["total_burst_steps"] > steps
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 31)), "one chunk per token"
    assert chunks[-1]["output_ids"] == expected[0] and chunks[-1]["text"] == expected[1]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    assert _pool_is_whole(burst)


def test_a_posted_message_ends_a_burst_after_one_step(engines, monkeypatch):
    single, burst = engines
    seen: list[int] = []
    real = BurstRunner.run

    def interrupted(self, batch, steps, interrupt=None):
        burst.abort("no-such-request")  # any message to the engine sets the interrupt
        results = real(self, batch, steps, interrupt)
        seen.append(len(results[0].tokens))
        return results

    monkeypatch.setattr(BurstRunner, "run", interrupted)
    held: list[tuple[int, int]] = []  # (pages a running request holds, pages its tokens need)
    after_step = burst.core.scheduler.after_step

    def check_pages(batch, *args):
        after_step(batch, *args)
        kv = burst.core.scheduler.kv
        held.extend(
            (len(r.kv.pages), max(kv.pages_for(r.num_tokens), r.kv.num_cached_pages))
            for r in batch.decodes
            if not r.finished
        )

    monkeypatch.setattr(burst.core.scheduler, "after_step", check_pages)
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    assert _run(burst, PROMPTS[:1], params) == _run(single, PROMPTS[:1], params)
    assert seen and set(seen) == {1}
    assert held and all(have == need for have, need in held), (
        "pages grown for a cut-short burst stay held"
    )


SAMPLED = [
    {"max_new_tokens": 40, "temperature": 0.8, "top_p": 0.9, "seed": 5, "ignore_eos": True},
    {"max_new_tokens": 13, "temperature": 0, "ignore_eos": True},
    {
        "max_new_tokens": 27,
        "temperature": 1.2,
        "top_k": 20,
        "min_p": 0.02,
        "seed": 6,
        "ignore_eos": True,
    },
]


def test_seeded_sampled_requests_burst_and_give_the_tokens_of_single_steps(engines, bursts):
    single, burst = engines
    expected = _run(single, PROMPTS, SAMPLED)
    got = _run(burst, PROMPTS, SAMPLED)
    assert got == expected
    assert bursts and 1 < max(len(row) for b in bursts for row in b)
    assert got[0][0] != _run(single, PROMPTS[:1], [{**SAMPLED[0], "seed": 50}])[0][0], (
        "the seed is used"
    )
    # n samples of one prompt: each has its own generator (seed + i)
    n2 = {**SAMPLED[0], "n": 2, "max_new_tokens": 20}
    assert _run(burst, [PROMPTS[1]], [n2]) == _run(single, [PROMPTS[1]], [n2])
    # a stop token inside a burst: the generator is rewound to the steps the burst ran
    ids = expected[0][0]
    index = next(i for i in range(6, 40) if ids.index(ids[i]) == i)
    stopped = [{**SAMPLED[0], "stop_token_ids": [ids[index]]}, SAMPLED[2]]
    assert _run(burst, [PROMPTS[0], PROMPTS[2]], stopped) == _run(
        single, [PROMPTS[0], PROMPTS[2]], stopped
    )
    assert _pool_is_whole(burst)


def test_an_interrupted_sampled_burst_rewinds_its_generator(engines, monkeypatch):
    single, burst = engines
    real = BurstRunner.run
    seen: list[int] = []

    def interrupted(self, batch, steps, interrupt=None):
        if len(seen) % 2 == 0:
            burst.abort("no-such-request")  # every other burst is cut to one step
        results = real(self, batch, steps, interrupt)
        seen.append(len(results[0].tokens))
        return results

    monkeypatch.setattr(BurstRunner, "run", interrupted)
    assert _run(burst, PROMPTS[:1], SAMPLED[:1]) == _run(single, PROMPTS[:1], SAMPLED[:1])
    assert 1 in seen and max(seen) > 1


def test_unseeded_sampled_requests_burst(engines, bursts):
    _, burst = engines
    out = _run(burst, PROMPTS[:1], [{"max_new_tokens": 30, "temperature": 1.0, "ignore_eos": True}])
    assert len(out[0][0]) == 30 and bursts


def test_penalized_and_logprob_requests_step_one_at_a_time(engines, bursts):
    _, burst = engines
    burst.generate(
        input_ids=PROMPTS[0],
        sampling_params={
            "max_new_tokens": 12,
            "temperature": 0.7,
            "frequency_penalty": 0.5,
            "ignore_eos": True,
        },
    )
    burst.generate(
        input_ids=PROMPTS[0],
        sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
    )
    burst.generate(
        input_ids=PROMPTS[0],
        sampling_params={"max_new_tokens": 12, "temperature": 0.7, "min_new_tokens": 12, "seed": 1},
    )
    assert not bursts


def test_num_continuous_decode_steps_is_validated(tiny_llama_dir):
    with pytest.raises(ValueError, match="num_continuous_decode_steps"):
        Engine(model_path=str(tiny_llama_dir), num_continuous_decode_steps=0)


def _zero_layer_burst(vocab: int = 50, hidden: int = 16, stops=((),)):
    """A model with no layers: logits = head @ rmsnorm(embed[token]), so the argmax chain is
    known."""
    torch.manual_seed(0)
    embed, head, norm = torch.randn(vocab, hidden), torch.randn(vocab, hidden), torch.ones(hidden)
    shape = decode_stack.DecodeShape(len(stops), hidden, 2, 1, 8, 32, 1e-5, 0.35, 0, 0)
    flat = torch.tensor([t for s in stops for t in s] or [0], dtype=torch.long)
    offsets = torch.tensor(
        [0, *torch.tensor([len(s) for s in stops]).cumsum(0).tolist()], dtype=torch.long
    )
    return embed, head, norm, shape, flat, offsets


def _burst(embed, head, norm, shape, flat, offsets, tables, lens, interrupt=None, num_slots=64):
    burst = decode_stack.DecodeBurst(
        embed=embed.data_ptr(),
        embed_rows=embed.shape[0],
        embed_scale=1.0,
        final_norm=norm.data_ptr(),
        head=decode_stack.dense_linear(head, None),
        tables=(ctypes.c_void_p * 2)(tables.data_ptr()),
        num_slots=(ctypes.c_int64 * 2)(num_slots),
        table_width=tables.shape[1],
        lens=lens.data_ptr(),
        stop_ids=flat.data_ptr(),
        stop_offsets=offsets.data_ptr(),
        interrupt=None if interrupt is None else ctypes.addressof(interrupt),
    )
    return burst


def _reference_chain(embed, head, norm, token: int, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        x = embed[token]
        h = x * torch.rsqrt(x.pow(2).mean() + 1e-5) * norm
        token = int((head @ h).argmax())
        out.append(token)
    return out


def test_the_native_burst_feeds_each_pick_to_the_next_step_and_stops():
    embed, head, norm, shape, flat, offsets = _zero_layer_burst()
    tables, lens = torch.arange(20, dtype=torch.long)[None], torch.tensor([3])
    ids, steps = torch.tensor([7]), 10
    scratch = torch.empty(decode_stack.burst_scratch_floats(1, shape, 50))
    burst = _burst(embed, head, norm, shape, flat, offsets, tables, lens)
    out = decode_stack.run_burst(
        (decode_stack.DecodeLayer * 0)(), 0, shape, burst, ids, steps, scratch
    )
    chain = _reference_chain(embed, head, norm, 7, steps)
    assert out[0].tolist() == chain
    stop_at = chain[2]
    embed, head, norm, shape, flat, offsets = _zero_layer_burst(stops=((stop_at,),))
    burst = _burst(embed, head, norm, shape, flat, offsets, tables, lens)
    out = decode_stack.run_burst(
        (decode_stack.DecodeLayer * 0)(), 0, shape, burst, ids, steps, scratch
    )
    assert out[0].tolist() == chain[: chain.index(stop_at) + 1]
    flag = ctypes.c_int32(1)
    burst = _burst(embed, head, norm, shape, flat, offsets, tables, lens, interrupt=flag)
    out = decode_stack.run_burst(
        (decode_stack.DecodeLayer * 0)(), 0, shape, burst, ids, steps, scratch
    )
    assert out.shape == (1, 1) and out[0, 0] == chain[0]


@pytest.mark.parametrize(
    "case, table_end, token",
    [
        ("slot outside the pool", 64, 7),
        ("table shorter than the burst", None, 7),
        ("token outside the vocabulary", 20, 50),
    ],
)
def test_a_bad_burst_raises_before_any_step(case, table_end, token):
    embed, head, norm, shape, flat, offsets = _zero_layer_burst()
    tables = torch.arange(20, dtype=torch.long)[None].clone()
    if table_end is None:
        tables = tables[:, :8].contiguous()
    else:
        tables[0, -1] = table_end if table_end == 64 else tables[0, -1]
    lens = torch.tensor([11])  # steps 10 need positions 10..19
    burst = _burst(embed, head, norm, shape, flat, offsets, tables, lens)
    scratch = torch.empty(decode_stack.burst_scratch_floats(1, shape, 50))
    with pytest.raises(IndexError, match="row 0"):
        decode_stack.run_burst(
            (decode_stack.DecodeLayer * 0)(),
            0,
            shape,
            burst,
            torch.tensor([token]),
            10,
            scratch,
        )


@pytest.mark.parametrize("winners", [(11, 29), (45, 49), (49,), (0, 3), (47, 48)])
def test_the_native_argmax_picks_the_first_maximum(winners):
    """Rows of the head equal to each other tie; the first wins, as torch's argmax, wherever the
    tie falls against the kernel's vector width and its tail (a vocabulary of 50)."""
    embed, head, norm, shape, flat, offsets = _zero_layer_burst()
    x = embed[7] * torch.rsqrt(embed[7].pow(2).mean() + 1e-5)
    for w in winners:
        head[w] = 10 * x / x.norm()
    tables, lens = torch.arange(20, dtype=torch.long)[None], torch.tensor([3])
    burst = _burst(embed, head, norm, shape, flat, offsets, tables, lens)
    scratch = torch.empty(decode_stack.burst_scratch_floats(1, shape, 50))
    out = decode_stack.run_burst(
        (decode_stack.DecodeLayer * 0)(),
        0,
        shape,
        burst,
        torch.tensor([7]),
        1,
        scratch,
    )
    assert out[0, 0] == min(winners) == int((head @ (x * norm)).argmax())


def test_the_native_burst_draws_sampled_rows_with_their_uniforms():
    """Row 0 samples (temperature 0.9, top-k 5) with a uniform per step, row 1 stays greedy: each
    draw is `sampling_cpu.sample_rows` on that step's logits with that step's uniform."""
    from plait.kernels import sampling_cpu

    embed, head, norm, shape, flat, offsets = _zero_layer_burst(stops=((), ()))
    tables, lens = torch.arange(40, dtype=torch.long).view(2, 20), torch.tensor([3, 3])
    steps = 8
    uniforms = torch.rand(2, steps, generator=torch.Generator().manual_seed(3))
    sampling = decode_stack.BurstSampling(
        temperature=torch.tensor([0.9, 0.0]),
        top_k=torch.tensor([5, 50]),
        top_p=torch.tensor([1.0, 1.0]),
        min_p=torch.tensor([0.0, 0.0]),
        uniforms=uniforms,
    )
    burst = _burst(embed, head, norm, shape, flat, offsets, tables, lens)
    burst.temperature, burst.top_k, burst.top_p, burst.min_p, burst.uniforms = sampling.pointers(
        2, steps
    )
    scratch = torch.empty(decode_stack.burst_scratch_floats(2, shape, 50))
    out = decode_stack.run_burst(
        (decode_stack.DecodeLayer * 0)(),
        0,
        shape,
        burst,
        torch.tensor([7, 7]),
        steps,
        scratch,
    )
    token = 7
    for s in range(steps):
        x = embed[token]
        logits = (head @ (x * torch.rsqrt(x.pow(2).mean() + 1e-5) * norm))[None]
        token = int(
            sampling_cpu.sample_rows(
                logits,
                torch.tensor([0.9]),
                torch.tensor([5]),
                torch.ones(1),
                torch.zeros(1),
                uniforms[0, s : s + 1],
            )
        )
        assert out[0, s] == token
    assert out[1].tolist() == _reference_chain(embed, head, norm, 7, steps)
    assert len(set(out[0].tolist())) > 1
    with pytest.raises(ValueError, match="uniforms"):
        decode_stack.BurstSampling(
            sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, uniforms[:, :3]
        ).pointers(2, steps)


def test_the_native_burst_applies_the_masks_its_callback_fills_and_ends_when_told():
    """A mask callback before each step: the picks are the argmax among the allowed tokens, the
    callback sees the tokens of the steps before, and a non-zero return ends the burst."""
    from plait.kernels.constraint_mask import allocate_token_bitmask

    embed, head, norm, shape, flat, offsets = _zero_layer_burst()
    tables, lens = torch.arange(20, dtype=torch.long)[None], torch.tensor([3])
    steps = 8
    out = torch.full((1, steps), -1, dtype=torch.long)
    bitmask, masked = allocate_token_bitmask(1, 50), torch.zeros(1, dtype=torch.int32)
    allowed_at = {s: sorted({(7 * s + 3 * j) % 50 for j in range(4)}) for s in range(steps)}
    seen: list[list[int]] = []

    def fill(step):
        seen.append(out[0, :step].tolist())
        if step == 6:
            return 1
        bitmask.zero_()
        for t in allowed_at[step]:
            bitmask[0, t // 32] |= 1 << (t % 32)
        masked[0] = 1 if step % 2 == 0 else 0  # odd steps are left unconstrained
        return 0

    callback = decode_stack.MASK_FN(fill)
    burst = _burst(embed, head, norm, shape, flat, offsets, tables, lens)
    burst.mask_fn, burst.bitmask, burst.masked, burst.mask_words = decode_stack.BurstMasks(
        callback, bitmask, masked
    ).pointers(1)
    scratch = torch.empty(decode_stack.burst_scratch_floats(1, shape, 50))
    got = decode_stack.run_burst(
        (decode_stack.DecodeLayer * 0)(),
        0,
        shape,
        burst,
        torch.tensor([7]),
        steps,
        scratch,
        out,
    )
    assert got.shape == (1, 6), "the callback ended the burst before step 6"
    token = 7
    for s in range(6):
        x = embed[token]
        logits = head @ (x * torch.rsqrt(x.pow(2).mean() + 1e-5) * norm)
        if s % 2 == 0:
            keep = torch.full_like(logits, float("-inf"))
            keep[allowed_at[s]] = logits[allowed_at[s]]
            logits = keep
        token = int(logits.argmax())
        assert got[0, s] == token, s
        assert seen[s] == got[0, :s].tolist()
