"""Prefill–decode handoff between two tiny engines in one process: one prefills and exports a
prompt's KV, the other imports it and decodes, token for token as an engine that did both.
Runs another engine cannot use (another page size, a flipped byte, a cut message) are misses;
held pages end with their request, their time, or a flush; no page is ever lost."""

from __future__ import annotations

import random
import time

import pytest

from plait import Engine
from plait.runtime.kv_tiers import handoff as handoff_module
from plait.runtime.kv_tiers.handoff import decode_runs, encode_runs

GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
LENGTHS = (2, 5, 17, 300)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def kwargs(model_dir, **extra) -> dict:
    return dict(
        model_path=str(model_dir),
        page_size=4,
        check_invariants=True,
        max_total_tokens=4096,
        **extra,
    )


def idle(engine: Engine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats["kv_pages_in_use"] == 0 and stats.get("kv_handoff_holds", 0) == 0:
            return stats
        assert time.monotonic() < deadline, f"pages still in use or held: {stats}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def colocated(tiny_llama_dir) -> dict[int, list[int]]:
    with Engine(**kwargs(tiny_llama_dir)) as engine:
        return {
            n: engine.generate(input_ids=prompt(n, n), sampling_params=GREEDY)["output_ids"]
            for n in LENGTHS
        }


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    with Engine(**kwargs(tiny_llama_dir)) as prefiller, Engine(**kwargs(tiny_llama_dir)) as decoder:
        yield prefiller, decoder


def test_decoding_imported_kv_gives_the_colocated_output(pair, colocated):
    prefiller, decoder = pair
    for n in LENGTHS:
        ids = prompt(n, n)
        prefilled = prefiller.handoff.prefill(input_ids=ids, sampling_params=GREEDY)
        assert prefilled.error is None
        assert prefilled.outputs[0]["output_ids"] == []  # prefilled, not decoded
        whole = (n - 1) // 4 * 4  # whole pages but the last token's
        assert [len(r.tokens) for r in prefilled.runs] == ([whole] if whole else [])
        imported = decoder.handoff.import_runs(prefilled.runs)
        assert imported.tokens == imported.new_tokens == whole and not imported.failures
        out = decoder.generate(input_ids=ids, sampling_params=GREEDY)
        assert out["output_ids"] == colocated[n]
        assert out["meta_info"]["cached_tokens"] == whole
        idle(decoder)
    stats = idle(prefiller)
    assert stats["kv_handoff_exports"] == 3 and stats["kv_handoff_exported_bytes"] > 0
    assert decoder.stats()["kv_handoff_imports"] == 3
    decoder.flush_cache()
    prefiller.flush_cache()


def test_samples_of_one_prompt_share_a_run_and_a_message_round_trips(pair, colocated):
    prefiller, decoder = pair
    ids = prompt(300, 300)
    params = {**GREEDY, "n": 3}
    prefilled = prefiller.handoff.prefill(input_ids=[ids, prompt(17, 17)], sampling_params=params)
    assert len(prefilled.runs) == 2 and len(prefilled.outputs) == 2
    message = b"".join(bytes(part) for part in encode_runs(prefilled.runs))
    assert len(message) == sum(r.nbytes for r in prefilled.runs)
    imported = decoder.handoff.import_runs(message)
    assert imported.runs == 2 and imported.tokens == 296 + 16
    outs = decoder.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [colocated[300]] * 3
    # a second import of what is cached copies nothing, and holds it again
    again = decoder.handoff.import_runs(decode_runs(message))
    assert again.tokens == 296 + 16 and again.new_tokens == 0
    # held: the 17-token run no request came for, and both runs again
    assert decoder.stats()["kv_handoff_holds"] == 3
    assert decoder.flush_cache()  # the holds end with the cache
    assert decoder.stats()["kv_handoff_holds"] == 0 and decoder.stats()["kv_pages_cached"] == 0
    prefiller.flush_cache()


def test_runs_another_engine_cannot_use_are_misses(pair, tiny_llama_dir, colocated):
    prefiller, decoder = pair
    ids = prompt(300, 300)
    runs = prefiller.handoff.prefill(input_ids=ids, sampling_params=GREEDY).runs
    # another page size: the same tokens name other KV
    with Engine(**{**kwargs(tiny_llama_dir), "page_size": 8}) as other:
        foreign = other.handoff.import_runs(runs)
        assert foreign.tokens == 0 and foreign.failures[0].startswith("foreign")
        assert other.stats()["kv_handoff_failures_foreign"] == 1
    # a flipped byte fails the checksum; a cut message is not runs at all
    message = bytearray(b"".join(bytes(part) for part in encode_runs(runs)))
    message[-5] ^= 0xFF
    corrupt = decoder.handoff.import_runs(bytes(message))
    assert corrupt.tokens == 0 and corrupt.failures[0].startswith("corrupt")
    with pytest.raises(ValueError, match="truncated"):
        decoder.handoff.import_runs(bytes(message[:-100]))
    stats = decoder.stats()
    assert stats["kv_handoff_failures_corrupt"] == 1 and stats["kv_handoff_failures_truncated"] == 1
    # the request prefills there: the same answer, nothing cached from the bad runs
    out = decoder.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["output_ids"] == colocated[300] and out["meta_info"]["cached_tokens"] == 0
    idle(decoder)
    decoder.flush_cache()
    prefiller.flush_cache()


def test_held_pages_end_after_their_time(pair, monkeypatch):
    prefiller, decoder = pair
    monkeypatch.setattr(handoff_module, "HANDOFF_HOLD_SECONDS", 0.05)
    runs = prefiller.handoff.prefill(input_ids=prompt(7, 100), sampling_params=GREEDY).runs
    decoder.handoff.import_runs(runs)  # no request follows
    stats = decoder.stats()
    assert stats["kv_handoff_holds"] == 1 and stats["kv_pages_evictable"] == 0
    stats = idle(decoder)  # the loop ends the hold once its time is up
    assert stats["kv_handoff_expired_holds"] >= 1
    assert stats["kv_pages_evictable"] == stats["kv_pages_cached"] == 99 // 4
    decoder.flush_cache()
    prefiller.flush_cache()


def test_sliding_window_models_refuse_the_handoff_with_a_reason(tmp_path, smollm_tokenizer):
    """Sliding-window layers keep their KV in window pages, which a handoff does not carry: asking
    such an engine for the handoff (as `plait serve --role` does at start) names why."""
    from tests.conftest import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "phi3", "phi3", smollm_tokenizer, sliding_window=24)
    engine = Engine(**kwargs(path))
    try:
        with pytest.raises(ValueError, match="kv handoff: .*sliding-window"):
            engine.core.kv_handoff()
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
        assert out["meta_info"]["completion_tokens"] == 10
    finally:
        engine.shutdown()
