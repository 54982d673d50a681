"""The Engine's public API on a tiny random-weight model: results, streaming, stops, errors,
pages."""

from __future__ import annotations

import asyncio
import threading

import pytest


def assert_all_pages_free(engine) -> None:
    stats = engine.stats()
    assert stats["kv_pages_in_use"] == 0, stats
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert stats["kv_pages_evictable"] == stats["kv_pages_cached"]  # nothing left locked


def wait_idle(engine, timeout: float = 10.0) -> None:
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        s = engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_pages_in_use"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def test_generate_returns_native_shape(tiny_engine):
    out = tiny_engine.generate("Hello there", GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 24
    assert meta["prompt_tokens"] == len(tiny_engine.tokenizer.encode("Hello there"))
    assert out["text"] == tiny_engine.tokenizer.decode(out["output_ids"])
    assert_all_pages_free(tiny_engine)


def test_batch_equals_one_by_one(tiny_engine):
    prompts = ["a b c", "The quick brown fox jumps", "1 2 3 4 5 6 7 8 9 10 11 12", "x"]
    alone = [tiny_engine.generate(p, GREEDY)["output_ids"] for p in prompts]
    together = tiny_engine.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in together] == alone


def test_concurrent_threads_get_their_own_results(tiny_engine):
    prompts = [f"request number {i} says" for i in range(12)]
    expected = {p: tiny_engine.generate(p, GREEDY)["text"] for p in prompts}
    got: dict[str, str] = {}

    def worker(p: str) -> None:
        got[p] = tiny_engine.generate(p, GREEDY)["text"]

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected
    wait_idle(tiny_engine)


def test_input_ids_and_max_new_tokens_zero(tiny_engine):
    ids = tiny_engine.tokenizer.encode("some prompt text")
    out = tiny_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_prompt_logprobs_shape(tiny_engine):
    ids = tiny_engine.tokenizer.encode("one two three four five")
    out = tiny_engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 3, "temperature": 0},
        return_logprob=True,
        logprob_start_len=1,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert [e[1] for e in inp] == ids[1:]
    assert inp[0][0] is None and all(isinstance(e[0], float) and e[0] <= 0 for e in inp[1:])
    assert inp[1][2] == tiny_engine.tokenizer.decode([ids[2]], skip_special_tokens=False)
    assert len(meta["input_top_logprobs"]) == len(inp) and meta["input_top_logprobs"][0] is None
    assert all(len(t) == 3 for t in meta["input_top_logprobs"][1:])
    out_lp = meta["output_token_logprobs"]
    assert [e[1] for e in out_lp] == out["output_ids"]
    # greedy: the chosen token is the top-1 of its distribution
    for (lp, tok, _), top in zip(out_lp, meta["output_top_logprobs"]):
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp)


def test_default_logprob_start_is_last_prompt_token(tiny_engine):
    out = tiny_engine.generate("a b c d", {"max_new_tokens": 2}, return_logprob=True)
    assert len(out["meta_info"]["input_token_logprobs"]) == 1
    assert out["meta_info"]["input_token_logprobs"][0][0] is None
    assert len(out["meta_info"]["output_token_logprobs"]) == 2


def test_stream_chunks_are_cumulative_and_end_with_final(tiny_engine):
    params = {"temperature": 1.0, "seed": 5, "max_new_tokens": 40, "ignore_eos": True}
    final = tiny_engine.generate("Stream this", params)
    chunks = list(tiny_engine.generate("Stream this", params, stream=True))
    texts = [c["text"] for c in chunks]
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a)
    assert texts[-1] == final["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_stream_never_shows_broken_utf8(tiny_engine):
    saw_multibyte = False
    for seed in range(6):
        params = {"temperature": 1.0, "seed": seed, "max_new_tokens": 48, "ignore_eos": True}
        chunks = [c["text"] for c in tiny_engine.generate("x", params, stream=True)]
        final = chunks[-1]
        full = tiny_engine.tokenizer.decode(tiny_engine.generate("x", params)["output_ids"])
        assert final == full
        for text in chunks[:-1]:
            assert "\ufffd" not in text[-1:] or "\ufffd" in full
        saw_multibyte |= any(ord(ch) > 127 for ch in final)
    assert saw_multibyte, "random tokens should include multi-byte characters"


def test_seed_reproduces_and_n_branches_differ(tiny_engine):
    params = {"temperature": 1.0, "seed": 42, "max_new_tokens": 16, "ignore_eos": True}
    a = tiny_engine.generate("seeded", params)["output_ids"]
    b = tiny_engine.generate("seeded", params)["output_ids"]
    c = tiny_engine.generate("seeded", {**params, "seed": 43})["output_ids"]
    assert a == b and a != c
    outs = tiny_engine.generate("seeded", {**params, "n": 3})
    assert len(outs) == 3 and outs[0]["output_ids"] == a
    assert len({tuple(o["output_ids"]) for o in outs}) == 3


def test_stop_string_across_token_boundary(tiny_engine):
    tok = tiny_engine.tokenizer
    ref = tiny_engine.generate("Stop me", GREEDY)
    pieces = [tok.decode([t]) for t in ref["output_ids"]]
    # pick a stop string that starts inside token 5 and ends inside token 6
    i = next(
        k for k in range(3, len(pieces) - 1) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 1
    )
    prefix = "".join(pieces[:i])
    stop = pieces[i][-1:] + pieces[i + 1][:1]
    first = (prefix + pieces[i] + pieces[i + 1]).find(stop)
    out = tiny_engine.generate("Stop me", {**GREEDY, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == ref["text"][:first]
    streamed = list(tiny_engine.generate("Stop me", {**GREEDY, "stop": stop}, stream=True))
    assert all(stop not in c["text"] for c in streamed)
    assert streamed[-1]["text"] == out["text"]


def test_stop_token_ids_and_min_new_tokens(tiny_engine):
    ref = tiny_engine.generate("Stop token", GREEDY)["output_ids"]
    target = ref[3]
    out = tiny_engine.generate("Stop token", {**GREEDY, "stop_token_ids": [target]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert out["output_ids"] == ref[: ref.index(target) + 1]
    longer = tiny_engine.generate(
        "Stop token", {**GREEDY, "stop_token_ids": [target], "min_new_tokens": 10}
    )
    assert len(longer["output_ids"]) >= 10


def test_async_generate(tiny_engine):
    async def main():
        single = await tiny_engine.async_generate("async one", GREEDY)
        many = await asyncio.gather(
            *(tiny_engine.async_generate(f"async {i}", GREEDY) for i in range(4))
        )
        chunks = [
            c async for c in await tiny_engine.async_generate("async one", GREEDY, stream=True)
        ]
        return single, many, chunks

    single, many, chunks = asyncio.run(main())
    assert single["text"] == tiny_engine.generate("async one", GREEDY)["text"]
    assert len(many) == 4 and chunks[-1]["text"] == single["text"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"text": "x", "sampling_params": {"max_new_tokens": -2}}, "max_new_tokens"),
        ({"text": "x", "sampling_params": {"nope": 1}}, "nope"),
        ({"text": None}, "text, input_ids"),
        ({"input_ids": [1, 10**9]}, "input_ids"),
        ({"text": "x", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"text": "x" * 5000}, "context length"),
    ],
)
def test_bad_input_raises_named_error_and_engine_survives(tiny_engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine.generate(**kwargs)
    assert (
        tiny_engine.generate("still alive", {"max_new_tokens": 2})["meta_info"]["completion_tokens"]
        == 2
    )
    assert_all_pages_free(tiny_engine)


def test_failing_forward_aborts_its_batch_frees_pages_and_keeps_serving(tiny_engine, monkeypatch):
    runner = tiny_engine.core.runner
    calls = {"n": 0}

    def flaky(original):  # the second forward pass fails, be it one step or a burst of them
        def run(*args):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return original(*args)

        return run

    monkeypatch.setattr(runner, "forward", flaky(runner.forward))
    monkeypatch.setattr(runner.bursts, "run", flaky(runner.bursts.run))
    out = tiny_engine.generate("will fail", {**GREEDY, "max_new_tokens": 8})
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "boom" in out["meta_info"]["finish_reason"]["message"]
    wait_idle(tiny_engine)
    monkeypatch.undo()
    assert (
        tiny_engine.generate("fine again", GREEDY)["meta_info"]["finish_reason"]["type"] == "length"
    )
    assert_all_pages_free(tiny_engine)


def test_abort_mid_stream_frees_pages(tiny_engine):
    params = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
    stream = tiny_engine.generate("abort me", params, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_idle(tiny_engine)
    assert_all_pages_free(tiny_engine)


def test_thread_governor_gives_the_thread_count_back(tiny_llama_dir):
    """The governor may run small steps on one thread; the process's count returns at shutdown."""
    import torch

    from plait import Engine

    before = torch.get_num_threads()
    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=512)
    if engine.core.thread_governor is not None:
        engine.core.thread_governor.choose = lambda num_tokens: 1  # as under a busy machine
    out = engine.generate(
        input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "ignore_eos": True}
    )
    assert len(out["output_ids"]) == 3
    engine.shutdown()
    assert torch.get_num_threads() == before


def test_fixed_cpu_threads_run_every_step_on_them(tiny_llama_dir, tiny_engine):
    from plait import Engine

    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    expected = tiny_engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=512, cpu_threads=1) as engine:
        assert engine.core.thread_governor is None
        assert (
            engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"] == expected
        )
        assert engine.stats()["cpu_threads"] == 1
