"""The SGLang-native protocol over real HTTP: /generate (single, list, input_ids, n, logprobs,
streaming, regex, rid + abort), model and server info, health, flush_cache, metrics."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tests.integration.server_support import (
    CONSTRAINTS_PENDING,
    sse_events,
    tiny_server,
    wait_until_idle,
)

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_generate_matches_the_engine(server, client):
    r = client.post("/generate", json={"text": "Hello there", "sampling_params": GREEDY})
    assert r.status_code == 200
    out = r.json()
    direct = server.engine.generate("Hello there", GREEDY)
    assert out["text"] == direct["text"] and out["output_ids"] == direct["output_ids"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"} <= set(meta)


def test_list_batching_returns_a_list_in_order(server, client):
    prompts = ["one", "two two", "three three three"]
    r = client.post("/generate", json={"text": prompts, "sampling_params": GREEDY})
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 3
    alone = [
        client.post("/generate", json={"text": p, "sampling_params": GREEDY}).json()
        for p in prompts
    ]
    assert [o["text"] for o in outs] == [a["text"] for a in alone]
    per_prompt = [{**GREEDY, "max_new_tokens": k} for k in (1, 2, 3)]
    ids = [server.engine.tokenizer.encode(p) for p in prompts]
    outs = client.post("/generate", json={"input_ids": ids, "sampling_params": per_prompt}).json()
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [1, 2, 3]


def test_n_samples_share_the_prompt(client):
    r = client.post(
        "/generate",
        json={"text": "Pick:", "sampling_params": {"max_new_tokens": 4, "n": 2, "seed": 3}},
    )
    outs = r.json()
    assert len(outs) == 2 and all(o["meta_info"]["completion_tokens"] == 4 for o in outs)


def test_prefill_only_with_prompt_logprobs(server, client):
    body = {
        "text": ["The cat sat", "The cat ran"],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": 0,
    }
    outs = client.post("/generate", json=body).json()
    for out, text in zip(outs, body["text"]):
        meta = out["meta_info"]
        assert out["text"] == "" and out["output_ids"] == []
        entries = meta["input_token_logprobs"]
        assert len(entries) == meta["prompt_tokens"] == len(server.engine.tokenizer.encode(text))
        assert entries[0][0] is None and all(isinstance(e[0], float) for e in entries[1:])
        assert "".join(e[2] for e in entries) == text
    # SGLang's select: logprob_start_len = prompt_tokens - 2
    body["logprob_start_len"] = 1
    outs = client.post("/generate", json=body).json()
    assert all(
        len(o["meta_info"]["input_token_logprobs"]) == o["meta_info"]["prompt_tokens"] - 1
        for o in outs
    )


def test_streaming_is_cumulative_and_terminated(client):
    body = {"text": "Count:", "sampling_params": {**GREEDY, "max_new_tokens": 8}, "stream": True}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["text"].startswith(prev["text"])
        assert cur["meta_info"]["completion_tokens"] >= prev["meta_info"]["completion_tokens"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    full = client.post("/generate", json={**body, "stream": False}).json()
    assert chunks[-1]["text"] == full["text"]


def test_streaming_a_list_tags_chunks_with_index(client):
    body = {"text": ["a", "b"], "sampling_params": {**GREEDY, "max_new_tokens": 3}, "stream": True}
    with client.stream("POST", "/generate", json=body) as r:
        events = sse_events(r.iter_lines())
    finals = [e for e in events[:-1] if e["meta_info"]["finish_reason"] is not None]
    assert sorted(e["index"] for e in finals) == [0, 1]


@CONSTRAINTS_PENDING
def test_regex_is_honored(client):
    pattern = r"(yes|no), [0-9]{2}"
    body = {
        "text": "Answer:",
        "sampling_params": {"max_new_tokens": 12, "regex": pattern, "temperature": 0.8, "seed": 1},
    }
    for out in client.post("/generate", json={**body, "text": ["Answer:", "Q?", "x"]}).json():
        assert re.fullmatch(pattern, out["text"]), out["text"]


def test_json_schema_as_an_object_or_its_text(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    sampling = {"max_new_tokens": 16, "temperature": 0}
    outs = [
        client.post(
            "/generate", json={"text": "JSON:", "sampling_params": {**sampling, "json_schema": s}}
        )
        for s in (schema, json.dumps(schema))
    ]
    assert [r.status_code for r in outs] == [200, 200], outs[0].text
    assert outs[0].json()["text"] == outs[1].json()["text"]
    assert set(json.loads(outs[0].json()["text"])) == {"n"}


def test_abort_request_by_rid(server, client):
    results = {}

    def run():
        body = {
            "text": "long",
            "rid": "abort-me",
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
        }
        results["out"] = client.post("/generate", json=body).json()

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while server.engine.stats()["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert client.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    t.join(timeout=30)
    meta = results["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 900
    wait_until_idle(server.engine)


def test_info_health_and_flush(server, client):
    info = client.get("/get_model_info").json()
    assert info["model_path"] == str(server.engine.model_path)
    assert info["chat_template"] and info["eos_token"] == "<|im_end|>"
    sinfo = client.get("/get_server_info").json()
    assert sinfo["context_length"] == server.engine.context_len
    assert {"kv_pages_total", "num_running", "cache_hit_rate"} <= set(sinfo["stats"])
    assert sinfo["server_config"]["api_key"] is None
    health = client.get("/health")
    assert health.status_code == 200
    served = client.get("/v1/models").json()["data"][0]["id"]
    assert health.json()["status"] == "ok" and health.json()["model"] == served
    assert health.json()["uptime_s"] >= 0
    assert client.get("/health_generate").status_code == 200
    wait_until_idle(server.engine)
    r = client.post("/flush_cache")
    assert r.status_code == 200 and "flushed" in r.text.lower()
    assert server.engine.stats()["kv_pages_cached"] == 0


def test_repeated_prompt_reports_cached_tokens(client):
    text = "A long shared system prompt that the second request should find in the cache. " * 3
    client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
    out = client.post(
        "/generate", json={"text": text + "again", "sampling_params": {"max_new_tokens": 1}}
    ).json()
    assert out["meta_info"]["cached_tokens"] > 0


def test_metrics(client):
    text = client.get("/metrics").text
    for name in (
        "plait_requests_total",
        "plait_prompt_tokens_total",
        "plait_generation_tokens_total",
        "plait_cached_tokens_total",
        "plait_cache_hit_rate",
        "plait_num_running_requests",
        "plait_num_queued_requests",
        "plait_kv_cache_usage_ratio",
        "plait_time_to_first_token_seconds_bucket",
        "plait_inter_token_latency_seconds_bucket",
        "plait_e2e_request_latency_seconds_bucket",
        "plait_engine_kv_pages_total",
    ):
        assert name in text, name
    ttft = re.search(r"^plait_time_to_first_token_seconds_count (\S+)$", text, re.M)
    assert ttft and float(ttft.group(1)) >= 1  # streamed requests ran above


def test_openapi_describes_every_sampling_param(client):
    """`/openapi.json` documents each field `sampling_params` accepts, and no other."""
    from dataclasses import fields

    from plait.runtime.protocol import SamplingParams

    spec = client.get("/openapi.json").json()
    request = spec["paths"]["/generate"]["post"]["requestBody"]
    body = request["content"]["application/json"]["schema"]
    sampling = body["properties"]["sampling_params"]["oneOf"][0]
    assert set(sampling["properties"]) == {f.name for f in fields(SamplingParams)}
    assert "object" in sampling["properties"]["json_schema"]["type"]
