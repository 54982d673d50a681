"""An Engine that is dropped, collected, shut down or leaves a `with` block releases its loop
thread, its KV pool and its weights; so do `Runtime` and a stopped server around it."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import httpx
import pytest

from plait import Engine

ARGS = {"max_total_tokens": 1024, "page_size": 4}
GREEDY = {"max_new_tokens": 4, "temperature": 0}


# engines of other test files (session fixtures) may be running: only threads started here count
OTHERS: set[threading.Thread] = set()


LOOP_THREADS = ("plait-engine",)  # the loop


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in LOOP_THREADS and t not in OTHERS]


def released(*refs: weakref.ref, timeout: float = 30.0) -> bool:
    """Whether every referent is gone and no engine thread of this file is left (collecting
    until then, for at most `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        if all(r() is None for r in refs) and not engine_threads():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def held(engine: Engine) -> tuple[weakref.ref, ...]:
    return (
        weakref.ref(engine.core.model),
        weakref.ref(engine.core.kv_pool),
        weakref.ref(engine.core.runner),
    )


@pytest.fixture(autouse=True)
def _others():
    OTHERS.update(t for t in threading.enumerate() if t.name in LOOP_THREADS)


def test_a_dropped_engine_releases_its_thread_pool_and_weights(tiny_llama_dir):
    engine = Engine(model_path=str(tiny_llama_dir), **ARGS)
    assert engine.generate("Hello", GREEDY)["meta_info"]["completion_tokens"] == 4
    assert [t.name for t in engine_threads()].count("plait-engine") == 1
    refs = held(engine)
    del engine
    assert released(*refs)


def test_a_dropped_engine_with_an_abandoned_stream_is_released(tiny_llama_dir):
    engine = Engine(model_path=str(tiny_llama_dir), **ARGS)
    stream = engine.generate("Hello", {"max_new_tokens": 64, "ignore_eos": True}, stream=True)
    next(stream)
    refs = held(engine) + (weakref.ref(engine),)
    del engine, stream
    assert released(*refs)


def test_leaving_a_with_block_releases_the_engine_while_it_is_still_named(tiny_llama_dir):
    with Engine(model_path=str(tiny_llama_dir), **ARGS) as engine:
        engine.generate("Hello", GREEDY)
        refs = held(engine)
    assert released(*refs)
    assert engine.stats()["kv_pages_in_use"] == 0
    with pytest.raises(RuntimeError, match="already shut down"):
        engine.generate("Hello", GREEDY)
    engine.shutdown()  # idempotent


def test_shutdown_ends_running_requests_and_a_second_engine_runs_alone(tiny_llama_dir):
    first = Engine(model_path=str(tiny_llama_dir), **ARGS)
    stream = first.generate("Hello", {"max_new_tokens": 500, "ignore_eos": True}, stream=True)
    next(stream)
    refs = held(first)
    first.shutdown()
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert released(*refs)
    second = Engine(model_path=str(tiny_llama_dir), **ARGS)
    try:
        assert [t.name for t in engine_threads()].count("plait-engine") == 1
        assert second.generate("Hello", GREEDY)["meta_info"]["completion_tokens"] == 4
    finally:
        second.shutdown()


def test_a_dropped_runtime_releases_its_engine(tiny_llama_dir):
    from plait import Runtime, gen, program

    @program
    def hello(s):
        s += "Hello" + gen("out", max_tokens=4, temperature=0)

    runtime = Runtime(str(tiny_llama_dir), **ARGS)
    assert hello.run(backend=runtime)["out"] is not None
    refs = held(runtime.engine)
    del runtime
    assert released(*refs)

    with Runtime(str(tiny_llama_dir), **ARGS) as runtime:
        hello.run(backend=runtime)
        refs = held(runtime.engine)
    assert released(*refs)


def test_a_stopped_server_lets_its_engine_go(tiny_llama_dir):
    from plait.server.launch import serve_in_thread

    engine = Engine(model_path=str(tiny_llama_dir), **ARGS)
    server = serve_in_thread(engine)
    body = {"text": "Hello", "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert list(r.iter_lines())
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    server.stop()
    refs = held(engine)
    del engine, server
    assert released(*refs)
