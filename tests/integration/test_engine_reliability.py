"""The engine under overload and faults, without the server: fair admission between clients,
deadlines, a step that raises, shutdown with requests in flight. Every request gets a final
result and every page is accounted for afterwards."""

from __future__ import annotations

import threading
import time

import pytest

from plait.runtime.protocol import SamplingParams
from plait.runtime.request import Request, SamplingState
from plait.runtime.schedule_policy import fair_order


def _req(rid: str, client: str) -> Request:
    return Request(
        rid=rid, prompt_ids=[1, 2], sampling=SamplingState(SamplingParams()), client_id=client
    )


def test_fair_order_round_robins_clients_least_loaded_first():
    flood = [_req(f"a{i}", "a") for i in range(5)]
    late = [_req("b0", "b"), _req("b1", "b")]
    order = fair_order(flood + late, active=[_req("ra", "a")])
    assert [r.rid for r in order] == ["b0", "a0", "b1", "a1", "a2", "a3", "a4"]
    assert fair_order(flood, active=[]) == flood  # one client: the policy's order


@pytest.fixture
def engine(tiny_llama_dir):
    from plait import Engine

    eng = Engine(
        model_path=str(tiny_llama_dir), max_total_tokens=4096, page_size=4, max_running_requests=2
    )
    yield eng
    eng.shutdown()


def _idle(engine) -> None:
    deadline = time.monotonic() + 10
    while engine.core.scheduler.has_work():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.core.scheduler.check()
    stats = engine.stats()
    assert stats["kv_pages_in_use"] == 0


def test_a_flood_does_not_starve_another_client(engine):
    finished: list[str] = []
    lock = threading.Lock()

    def run(rid: str, client: str, tokens: int) -> None:
        engine.generate(
            text=f"{rid} says",
            rid=rid,
            client_id=client,
            sampling_params={"max_new_tokens": tokens, "ignore_eos": True},
        )
        with lock:
            finished.append(rid)

    # long enough that four of them still wait when the short request comes (a step of the tiny
    # model takes well under a millisecond)
    flood = [threading.Thread(target=run, args=(f"a{i}", "a", 300)) for i in range(6)]
    for t in flood:
        t.start()
    deadline = time.monotonic() + 30
    while engine.stats()["num_waiting"] < 4:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.005)
    short = threading.Thread(target=run, args=("b0", "b", 4))
    short.start()
    for t in [*flood, short]:
        t.join(timeout=60)
    assert len(finished) == 7
    assert finished.index("b0") <= 3, finished  # admitted at the first free slot, not the 7th
    _idle(engine)


def test_deadline_aborts_and_frees_pages(engine):
    from plait.runtime.events import StepFinished

    # every step outlasts the deadline (a subscriber runs on the engine's thread), so the request
    # expires after its first step, holding pages, however fast the model decodes
    slow = engine.events.subscribe(lambda event: time.sleep(0.3), StepFinished)
    try:
        out = engine.generate(
            text="x", timeout=0.2, sampling_params={"max_new_tokens": 900, "ignore_eos": True}
        )
    finally:
        slow.unsubscribe()
    assert 0 < out["meta_info"]["completion_tokens"] < 900
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 504
    with pytest.raises(ValueError, match="timeout"):
        engine.generate(text="x", timeout=0)
    _idle(engine)


def test_a_step_that_raises_fails_its_requests_and_the_loop_goes_on(engine, monkeypatch):
    real = engine.core.scheduler.schedule
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected scheduler fault")
        return real()

    monkeypatch.setattr(engine.core.scheduler, "schedule", broken)
    out = engine.generate(text="x", sampling_params={"max_new_tokens": 20, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["status_code"] == 500
    ok = engine.generate(text="y", sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert ok["meta_info"]["finish_reason"]["type"] == "length"
    _idle(engine)


def test_shutdown_answers_every_request(engine):
    results: list[dict] = []

    def run(i: int) -> None:
        results.append(
            engine.generate(
                text=f"{i}", sampling_params={"max_new_tokens": 900, "ignore_eos": True}
            )
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while engine.stats()["num_running"] < 2:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.005)
    engine.shutdown()
    for t in threads:
        t.join(timeout=15)
    assert len(results) == 4
    assert {r["meta_info"]["finish_reason"].get("status_code") for r in results} == {503}
    engine.core.scheduler.check()
