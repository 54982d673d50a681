"""The radix cache and the continuous-batching scheduler: same outputs under any load, pages
always accounted for, prefixes computed once."""

from __future__ import annotations

import random
import threading
import time

import pytest

from plait import Engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}


def workload(seed: int = 0, n: int = 32) -> list[tuple[str, dict]]:
    """Varied prompts: shared prefixes of different lengths, different outputs, some stop
    strings."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    prefixes = [" ".join(rng.choices(words, k=k)) for k in (40, 12, 3)]
    items = []
    for i in range(n):
        prompt = rng.choice(prefixes) + " " + " ".join(rng.choices(words, k=rng.randint(1, 25)))
        params = {**GREEDY, "max_new_tokens": rng.randint(4, 28)}
        if i % 5 == 0:
            params["stop"] = [rng.choice(["a", "e", " t", "s"])]
        items.append((prompt, params))
    return items


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[dict]:
    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, disable_radix_cache=True)
    try:
        return [engine.generate(p, sp) for p, sp in workload()]
    finally:
        engine.shutdown()


def run_concurrently(engine: Engine, items: list[tuple[str, dict]]) -> list[dict]:
    results: list[dict | None] = [None] * len(items)

    def worker(i: int) -> None:
        results[i] = engine.generate(*items[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results  # type: ignore[return-value]


def wait_idle(engine: Engine) -> None:
    deadline = time.time() + 10
    while engine.stats()["num_running"] or engine.stats()["num_waiting"]:
        assert time.time() < deadline, engine.stats()
        time.sleep(0.01)


def assert_idle_and_accounted(engine: Engine) -> None:
    wait_idle(engine)
    s = engine.stats()
    assert s["kv_pages_in_use"] == 0, s
    assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]


CONFIGS = {
    "default": dict(max_total_tokens=4096),
    "page16": dict(max_total_tokens=4096, page_size=16),
    "tiny-pool": dict(max_total_tokens=160, page_size=4, max_running_requests=32),
    "chunked": dict(max_total_tokens=4096, chunked_prefill_size=8, max_prefill_tokens=24),
    "fcfs": dict(max_total_tokens=4096, schedule_policy="fcfs"),
    "dfs-weight": dict(max_total_tokens=4096, schedule_policy="dfs-weight", page_size=2),
    "no-cache": dict(max_total_tokens=4096, disable_radix_cache=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_concurrent_requests_equal_running_alone(tiny_llama_dir, reference, name):
    engine = Engine(model_path=str(tiny_llama_dir), check_invariants=True, **CONFIGS[name])
    try:
        got = run_concurrently(engine, workload())
        for ref, out in zip(reference, got):
            assert out["output_ids"] == ref["output_ids"]
            assert out["text"] == ref["text"]
            assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
        stats = engine.stats()
        if name != "no-cache":
            assert stats["cache_hit_rate"] > 0.2
        assert_idle_and_accounted(engine)
    finally:
        engine.shutdown()


def test_retraction_when_decode_outgrows_the_pool(tiny_llama_dir):
    prompts = [f"item {i}:" for i in range(6)]
    params = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    alone = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, disable_radix_cache=True)
    try:
        expected = [alone.generate(p, params)["output_ids"] for p in prompts]
    finally:
        alone.shutdown()
    # 16 pages of 4: admission reserves only part of each request's 40 tokens, so decode runs short
    engine = Engine(
        model_path=str(tiny_llama_dir), max_total_tokens=64, page_size=4, check_invariants=True
    )
    try:
        got = run_concurrently(engine, [(p, params) for p in prompts])
        assert [g["output_ids"] for g in got] == expected
        assert engine.stats()["num_retracted"] > 0
        assert_idle_and_accounted(engine)
    finally:
        engine.shutdown()


def test_shared_prefix_is_computed_once(tiny_llama_dir):
    # an engine of its own: the computed-token count is the engine's, so nothing else may run on it
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, page_size=4) as engine:
        prefix = " ".join(f"shared{i}" for i in range(60))
        first = engine.generate(prefix + " question one", {"max_new_tokens": 1})
        before = engine.stats()["total_computed_tokens"]
        second = engine.generate(prefix + " question two?", {"max_new_tokens": 1})
        computed = engine.stats()["total_computed_tokens"] - before
        shared = len(engine.tokenizer.encode(prefix))
        prompt_len = second["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= shared - engine.page_size
    assert computed == prompt_len - second["meta_info"]["cached_tokens"]


def test_abort_mid_prefill_and_mid_decode(tiny_llama_dir, reference):
    engine = Engine(
        model_path=str(tiny_llama_dir),
        max_total_tokens=4096,
        chunked_prefill_size=4,
        max_prefill_tokens=8,
        check_invariants=True,
    )
    try:
        items = workload()[:6]
        long_prompt = " ".join(["filler"] * 300)
        long_params = {**GREEDY, "max_new_tokens": 400}
        results: dict[str, dict] = {}

        def call(key: str, prompt: str, params: dict, rid: str | None = None) -> None:
            results[key] = engine.generate(prompt, params, rid=rid)

        threads = [
            threading.Thread(target=call, args=(f"ok{i}", p, sp)) for i, (p, sp) in enumerate(items)
        ]
        threads.append(
            threading.Thread(
                target=call, args=("prefill", long_prompt, long_params, "abort-prefill")
            )
        )
        # long enough to be still decoding when it is aborted: a tiny model decodes 400 tokens in
        # a few tenths of a second
        decode_params = {**GREEDY, "max_new_tokens": 2000}
        threads.append(
            threading.Thread(target=call, args=("decode", "short", decode_params, "abort-decode"))
        )
        for t in threads:
            t.start()
        deadline = time.time() + 60
        sched = engine.core.scheduler
        # its 300-token prompt needs ~40 steps of 8 tokens: abort it part-way through (a tiny model
        # runs a step in well under a millisecond, so no fixed sleep lands there reliably)
        while not any(
            r.rid == "abort-prefill" and r.kv.num_computed > 0
            for r in sched.prefilling + sched.running
        ):
            assert "prefill" not in results, "the request finished before it could be aborted"
            assert time.time() < deadline
            time.sleep(0.001)
        engine.abort("abort-prefill")
        while not any(r.rid == "abort-decode" and r.output_ids for r in sched.running):
            assert "decode" not in results, "the request finished before it could be aborted"
            assert time.time() < deadline
            time.sleep(0.005)
        engine.abort("abort-decode")
        for t in threads:
            t.join(timeout=300)
        assert results["prefill"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert results["prefill"]["meta_info"]["completion_tokens"] < 400
        assert results["decode"]["meta_info"]["finish_reason"]["type"] == "abort"
        for i in range(len(items)):
            assert results[f"ok{i}"]["output_ids"] == reference[i]["output_ids"]
        assert_idle_and_accounted(engine)
    finally:
        engine.shutdown()


def test_request_larger_than_pool_is_rejected(tiny_llama_dir):
    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=64)
    try:
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.generate("hello", {"max_new_tokens": 100})
        assert (
            engine.generate("hello", {"max_new_tokens": 8})["meta_info"]["completion_tokens"] == 8
        )
    finally:
        engine.shutdown()


def test_flush_cache(tiny_engine):
    tiny_engine.generate("cache me please", {"max_new_tokens": 2})
    assert tiny_engine.stats()["kv_pages_cached"] > 0
    assert tiny_engine.flush_cache() is True
    s = tiny_engine.stats()
    assert s["kv_pages_cached"] == 0 and s["kv_pages_free"] == s["kv_pages_total"]
