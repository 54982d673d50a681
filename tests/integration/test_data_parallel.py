"""The data-parallel router on loopback in front of two tiny in-process replicas: every API goes
through it, shared prefixes land where they are cached, bad input stays a 400."""

from __future__ import annotations

import random
import textwrap
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import NotFoundError, OpenAI

from tests.integration.server_support import sse_events, tiny_server

PROGRAMS = """
from plait import assistant, gen, program, system, user


@program
def qa(s, question: str):
    s += system("Answer in a few words.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=6, temperature=0))
"""


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    from plait.server.launch import ServerThread
    from plait.server.router_app import create_router_app
    from plait.server.routing import RouterConfig

    path = tmp_path_factory.mktemp("dp-programs") / "dp_programs.py"
    path.write_text(textwrap.dedent(PROGRAMS))
    with (
        tiny_server(tiny_llama_dir, programs=(str(path),)) as a,
        tiny_server(tiny_llama_dir, programs=(str(path),)) as b,
    ):
        app = create_router_app([a.url, b.url], RouterConfig(health_interval=0.2))
        with ServerThread(app) as router:
            router.replicas = (a, b)
            yield router
        app.state.router.close()


@pytest.fixture
def client(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as c:
        yield c


def _workload(num_prefixes: int = 4, per_prefix: int = 6) -> list[str]:
    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud maple ember quartz violet harbor".split()
    prefixes = [
        f"System {p}: " + " ".join(rng.choice(words) for _ in range(40))
        for p in range(num_prefixes)
    ]
    prompts = [
        f"{pre}\nQuestion {q}: what is {rng.choice(words)}?"
        for q in range(per_prefix)
        for pre in prefixes
    ]
    return prompts


def _hit_rate(url: str, prompts: list[str]) -> float:
    def one(prompt: str) -> dict:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    first = [one(p) for p in prompts[:4]]  # each prefix once, then the rest concurrently
    with ThreadPoolExecutor(4) as pool:
        metas = first + list(pool.map(one, prompts[4:]))
    return sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)


def _flush(url: str) -> None:
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200


def test_shared_prefixes_land_on_the_replica_that_holds_them(cluster):
    prompts = _workload()
    a = cluster.replicas[0]
    _flush(cluster.url)
    single = _hit_rate(a.url, prompts)
    _flush(cluster.url)
    routed = _hit_rate(cluster.url, prompts)
    print(f"hit rate: single replica {single:.2f}, routed over two {routed:.2f}")
    assert routed >= single - 0.10, (routed, single)
    served = [r["served"] for r in httpx.get(cluster.url + "/health").json()["replicas"]]
    assert all(s > 0 for s in served), served  # both replicas took a share of the prefixes


def test_openai_streaming_and_chat_through_the_router(cluster):
    oai = OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    model = oai.models.list().data[0].id
    assert model == cluster.replicas[0].engine.model_path.rsplit("/", 1)[-1]  # the folder's name
    with pytest.raises(NotFoundError):  # the replica's 404 comes back through the router
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    chat = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
    )
    assert chat.usage.completion_tokens >= 1
    text = "".join(
        c.choices[0].text
        for c in oai.completions.create(
            model=model, prompt="Once upon", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    direct = httpx.post(
        cluster.replicas[1].url + "/v1/completions",
        json={"model": model, "prompt": "Once upon", "max_tokens": 6, "temperature": 0},
    ).json()
    assert text == direct["choices"][0]["text"]


def test_native_stream_and_programs(client):
    with client.stream(
        "POST",
        "/generate",
        json={
            "text": "1, 2, 3,",
            "stream": True,
            "sampling_params": {"max_new_tokens": 5},
        },
    ) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["completion_tokens"] == 5
    out = client.post("/programs/qa", json={"arguments": {"question": "Why?"}}).json()
    assert "answer" in out["variables"]
    with client.stream(
        "POST", "/programs/qa", json={"arguments": {"question": "Why?"}, "stream": True}
    ) as r:
        events = sse_events(r.iter_lines())
    assert events[-2]["event"] == "done" and events[-2]["variables"] == out["variables"]
    assert [p["name"] for p in client.get("/programs").json()["programs"]] == ["qa"]
    assert client.get("/get_model_info").json()["model_path"]


def test_bad_input_is_a_400_naming_the_field(client):
    r = client.post("/generate", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = client.post("/generate", json={"text": "x", "sampling_params": {"temperature": -1}})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert client.post("/programs/missing", json={}).status_code == 404


def test_health_info_and_metrics_report_replicas(client, cluster):
    health = client.get("/health").json()
    assert health["status"] == "ok" and len(health["replicas"]) == 2
    info = client.get("/get_server_info").json()
    assert {r["url"] for r in info["router"]["replicas"]} == {s.url for s in cluster.replicas}
    text = client.get("/metrics").text
    assert "plait_router_replica_up{" in text and "plait_router_requests_total{" in text
