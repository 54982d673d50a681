"""Prefill–decode disaggregation on loopback: a tiny prefill server and a tiny decode server
behind the router answer every API token for token as a colocated server does, with the
prompts' KV pushed from one to the other; bad input stays the client's 400; the roles refuse
what is not theirs; a prefill server that is gone costs a prefill, not a request."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from openai import OpenAI

from tests.integration.server_support import sse_events, tiny_server, wait_until_idle

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = "alpha beta gamma delta river stone cloud maple ember quartz violet harbor".split()
    return " ".join(rng.choice(vocab) for _ in range(words))


PROMPTS = [_text(0, 3), _text(1, 40), _text(2, 200)]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    from plait.server.launch import ServerThread
    from plait.server.router_app import create_router_app
    from plait.server.routing import Router, RouterConfig

    with (
        tiny_server(tiny_llama_dir) as colocated,
        tiny_server(tiny_llama_dir, role="prefill") as prefill,
        tiny_server(tiny_llama_dir, role="decode") as decode,
    ):
        router = Router.for_urls([decode.url], RouterConfig(health_interval=0.2), [prefill.url])
        app = create_router_app(router)
        with ServerThread(app) as server:
            server.colocated, server.prefill, server.decode = colocated, prefill, decode
            server.router = router
            yield server
        app.state.router.close()


def _generate(url: str, text: str, **extra) -> dict:
    body = {"text": text, "sampling_params": GREEDY, **extra}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, name: str) -> float:
    """The sum of a metric's series (all of them, or the one `name` names with its labels)."""
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        series = line.split(" ")[0]
        if series == name or ("{" not in name and series.startswith(name + "{")):
            total += float(line.split()[-1])
    return total


def _idle(engine) -> None:
    wait_until_idle(engine)
    deadline = time.monotonic() + 10
    while engine.stats().get("kv_handoff_holds", 0):
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)


def test_native_outputs_equal_the_colocated_servers(cluster):
    for text in PROMPTS:
        want = _generate(cluster.colocated.url, text)
        got = _generate(cluster.url, text)
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
        prompt_tokens = got["meta_info"]["prompt_tokens"]
        # all but the last token's page came from the prefill server
        assert got["meta_info"]["cached_tokens"] == (prompt_tokens - 1) // 4 * 4
    # a list of prompts, and a stream (the 3-word prompt has no whole page to hand off)
    batch = httpx.post(
        cluster.url + "/generate", json={"text": PROMPTS, "sampling_params": GREEDY}, timeout=60
    ).json()
    assert [o["output_ids"] for o in batch] == [
        _generate(cluster.colocated.url, t)["output_ids"] for t in PROMPTS
    ]
    body = {"text": PROMPTS[2], "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["output_ids"] == batch[2]["output_ids"]

    prefill_stats = cluster.prefill.engine.stats()
    decode_stats = cluster.decode.engine.stats()
    assert prefill_stats["kv_handoff_exports"] == 5 and prefill_stats["total_generated_tokens"] == 0
    assert decode_stats["kv_handoff_imported_tokens"] > 0
    assert _metric(cluster.url, "plait_router_kv_handoff_bytes_total") > 0
    ok = _metric(cluster.url, "plait_router_kv_handoffs_total")
    series = f'plait_router_kv_handoffs_total{{outcome="ok",replica="{cluster.prefill.url}"}}'
    assert ok >= 5 and ok == _metric(cluster.url, series)
    for server in (cluster.prefill, cluster.decode):
        _idle(server.engine)


def test_openai_routes_equal_the_colocated_servers(cluster):
    answers = []
    for url in (cluster.colocated.url, cluster.url):
        client = OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": PROMPTS[2]}, {"role": "user", "content": "Hi"}]
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0
        )
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        done = client.completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0
        )
        answers.append((chat.choices[0].message.content, streamed, done.choices[0].text))
    assert answers[0] == answers[1]
    assert cluster.decode.engine.stats()["cache_hit_rate"] > 0.5
    for server in (cluster.prefill, cluster.decode):
        _idle(server.engine)


def test_short_prompts_can_be_prefilled_where_they_decode(cluster):
    import dataclasses

    router = cluster.router
    config = router.config
    router.config = dataclasses.replace(config, prefill_min_chars=600)  # 40 words < 600 < 200
    try:
        handoffs = _metric(cluster.url, "plait_router_kv_handoffs_total")
        short = _generate(cluster.url, _text(11, 40))  # new prompts: nothing cached
        assert short["meta_info"]["cached_tokens"] == 0  # prefilled on the decode server
        assert _metric(cluster.url, "plait_router_kv_handoffs_total") == handoffs
        long = _generate(cluster.url, _text(12, 200))
        assert long["meta_info"]["cached_tokens"] > 0
        assert _metric(cluster.url, "plait_router_kv_handoffs_total") == handoffs + 1
    finally:
        router.config = config
    _idle(cluster.decode.engine)


def test_bad_input_is_the_prefill_servers_400(cluster):
    served = cluster.decode.engine.stats()["total_requests"]
    body = {"text": "hi", "sampling_params": {"temperature": -1}}
    r = httpx.post(cluster.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert cluster.decode.engine.stats()["total_requests"] == served  # never sent on


def test_roles_refuse_what_is_not_theirs(cluster):
    from plait.server.kv_handoff import HANDOFF_HEADER

    header = {HANDOFF_HEADER: cluster.decode.url}
    body = {"text": "hi", "sampling_params": GREEDY}
    for server in (cluster.colocated, cluster.decode):
        r = httpx.post(server.url + "/generate", json=body, headers=header, timeout=30)
        assert r.status_code == 400 and "role" in r.json()["error"]["message"]
        if server is not cluster.decode:
            assert httpx.post(server.url + "/kv/import", content=b"", timeout=30).status_code == 404
    r = httpx.post(cluster.decode.url + "/kv/import", content=b"not runs", timeout=30)
    assert r.status_code == 400 and "kv runs" in r.json()["error"]["message"]
    # the prefill server answers a whole request itself (the router's fallback), and the
    # router's client cannot name where KV goes
    assert _generate(cluster.prefill.url, PROMPTS[0])["output_ids"]
    r = httpx.post(cluster.url + "/generate", json=body, headers=header, timeout=30)
    assert r.status_code == 200


def test_a_prefill_server_that_is_gone_costs_a_prefill(tiny_llama_dir):
    from plait.server.launch import ServerThread, free_port
    from plait.server.router_app import create_router_app
    from plait.server.routing import Router, RouterConfig

    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with (
        tiny_server(tiny_llama_dir) as colocated,
        tiny_server(tiny_llama_dir, role="decode") as decode,
    ):
        router = Router.for_urls([decode.url], RouterConfig(health_interval=30), [gone])
        app = create_router_app(router)
        with ServerThread(app) as server:
            got = _generate(server.url, PROMPTS[2])
            assert got["output_ids"] == _generate(colocated.url, PROMPTS[2])["output_ids"]
            assert got["meta_info"]["cached_tokens"] == 0  # prefilled where it decoded
            health = httpx.get(server.url + "/health").json()
            assert [(r["role"], r["healthy"]) for r in health["replicas"]] == [
                ("decode", True),
                ("prefill", False),
            ]
            failed = f'plait_router_kv_handoffs_total{{outcome="prefill_failed",replica="{gone}"}}'
            assert _metric(server.url, failed) == 1
            # no prefill replica left: requests go to the decode replica alone
            assert _generate(server.url, PROMPTS[1])["output_ids"]
            assert _metric(server.url, "plait_router_kv_handoffs_total") == 2
        app.state.router.close()
        _idle(decode.engine)
