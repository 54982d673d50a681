"""`EngineTrace` on a real tiny engine: a Chrome trace whose steps and requests agree with the
engine's own events and results, that stops recording when closed and drops past its bound."""

from __future__ import annotations

import json
import threading

import pytest

from plait.runtime.events import StepFinished
from plait.runtime.tracing import EngineTrace

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def trace_engine(tiny_llama_dir):
    from plait import Engine

    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, page_size=4)
    yield engine
    engine.shutdown()


def records_of(trace: EngineTrace, name: str) -> list[dict]:
    return [r for r in trace.to_json()["traceEvents"] if r.get("name") == name]


def test_steps_and_requests_agree_with_the_engine(trace_engine, tmp_path):
    steps_seen: list[StepFinished] = []
    prompts = [f"Request number {i} of a traced batch" for i in range(4)]
    with trace_engine.events.subscribe(steps_seen.append, kinds=StepFinished):
        with EngineTrace(trace_engine.events) as trace:
            threads = []
            outs: dict[int, dict] = {}
            for i, p in enumerate(prompts):  # submitted from several threads at once

                def run(i: int = i, p: str = p) -> None:
                    outs[i] = trace_engine.generate(p, GREEDY)

                threads.append(threading.Thread(target=run))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    steps = records_of(trace, "step")
    assert len(steps) == len(steps_seen)
    assert [s["args"]["decode_tokens"] for s in steps] == [e.decode_tokens for e in steps_seen]
    assert sum(s["args"]["prefill_tokens"] for s in steps) == sum(
        e.prefill_tokens for e in steps_seen
    )
    assert all(s["dur"] >= 0 and s["ts"] >= 0 for s in steps)
    requests = records_of(trace, "request")
    begins = {r["id"]: r for r in requests if r["ph"] == "b"}
    ends = {r["id"]: r for r in requests if r["ph"] == "e"}
    assert set(begins) == set(ends) == {o["meta_info"]["id"] for o in outs.values()}
    for out in outs.values():
        rid = out["meta_info"]["id"]
        assert ends[rid]["ts"] >= begins[rid]["ts"]
        assert ends[rid]["args"]["output_tokens"] == out["meta_info"]["completion_tokens"] == 6
        assert ends[rid]["args"]["finish_reason"] == "length"
        assert begins[rid]["args"]["prompt_tokens"] == out["meta_info"]["prompt_tokens"]
    # every request's steps lie inside its span
    first_begin = min(r["ts"] for r in begins.values())
    last_end = max(r["ts"] for r in ends.values())
    assert all(first_begin <= s["ts"] and s["ts"] + s["dur"] <= last_end + 1 for s in steps)

    path = trace.write(tmp_path / "trace.json")
    written = json.loads(path.read_text())
    assert written["traceEvents"] == trace.to_json()["traceEvents"]
    names = {r["args"]["name"] for r in written["traceEvents"] if r["name"] == "thread_name"}
    assert names == {"steps", "requests", "cache"}


def test_a_closed_trace_records_nothing_more(trace_engine):
    trace = EngineTrace(trace_engine.events)
    trace_engine.generate("before the close", GREEDY)
    trace.close()
    count = trace.num_events
    assert count > 0
    trace_engine.generate("after the close", GREEDY)
    assert trace.num_events == count
    trace.close()  # closing twice is fine


def test_the_trace_keeps_at_most_max_events(trace_engine):
    with EngineTrace(trace_engine.events, max_events=3) as trace:
        trace_engine.generate("a request of several steps", GREEDY)
    assert trace.num_events == 3
    assert trace.dropped > 0
    assert trace.to_json()["otherData"]["dropped_events"] == trace.dropped


def test_max_events_is_validated(trace_engine):
    with pytest.raises(ValueError, match="max_events"):
        EngineTrace(trace_engine.events, max_events=0)


def test_plait_serve_writes_its_trace_when_it_stops(tiny_llama_dir, tmp_path):
    """`plait serve --trace-file`: the requests it served are in the file it writes on SIGTERM."""
    import httpx

    from plait.server.launch import ServerProcess

    path = tmp_path / "serve-trace.json"
    args = ["--model", str(tiny_llama_dir), "--max-total-tokens", "2048", "--trace-file", str(path)]
    with ServerProcess(args, timeout=120) as server:
        body = {"text": "A traced request", "sampling_params": GREEDY}
        out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert server.process.returncode == 0
    records = json.loads(path.read_text())["traceEvents"]
    ends = [r for r in records if r.get("name") == "request" and r["ph"] == "e"]
    assert [r["id"] for r in ends] == [out["meta_info"]["id"]]
    assert ends[0]["args"]["output_tokens"] == 6
    assert any(r.get("name") == "step" for r in records)
