"""`/dashboard/snapshot` on a real server: the tree, history and requests it reports after
traffic with shared prefixes, who made each request, prompt text only when allowed, the probe
off when nobody watches, the API key, and the router's view per replica."""

from __future__ import annotations

import time

import httpx
import pytest

from plait import assistant, gen, program, user
from tests.integration.dashboard_support import send, shared_prefix_prompts, wait_for
from tests.integration.server_support import tiny_server, wait_until_idle


@program
def qa(s, question: str):
    s += user(question)
    s += assistant(gen("answer", max_tokens=4, temperature=0))


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from plait import Engine
    from plait.server.app import create_app
    from plait.server.dashboard import DashboardConfig
    from plait.server.launch import ServerThread

    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, page_size=4)
    config = DashboardConfig(interval=0.1, idle_after=3.0)
    app = create_app(engine, program_registry={"qa": qa}, dashboard=config)
    with ServerThread(app) as srv:
        srv.engine = engine
        yield srv
    engine.shutdown()


def _snap(url: str, **params) -> dict:
    r = httpx.get(url + "/dashboard/snapshot", params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _watched(engine) -> set[str]:
    """The engine events the probe subscribes to (the requests panel's `RequestSubmitted` is
    always on); no method of the scheduler or the cache is ever replaced on its instance."""
    from plait.runtime.events import EVENT_KINDS, RequestSubmitted

    assert not set(vars(engine.core.scheduler)) & {"schedule", "after_step", "retract"}
    assert not set(vars(engine.core.cache)) & {"evict", "match_prefix", "insert"}
    return {k.__name__ for k in EVENT_KINDS if k is not RequestSubmitted and engine.events.wants(k)}


def test_snapshot_after_shared_prefix_traffic(server):
    url, engine = server.url, server.engine
    _snap(url)  # someone starts watching: the probe goes on
    assert _watched(engine) == {
        "StepFinished",
        "RequestFinished",
        "RequestRetracted",
        "CacheEvicted",
        "CacheMatched",
    }
    prompts = shared_prefix_prompts(num_prefixes=2, per_prefix=3)
    send(url, prompts)
    httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    httpx.post(url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 3}, timeout=60)
    assert httpx.post(
        url + "/programs/qa", json={"arguments": {"question": "Why?"}}, timeout=60
    ).is_success
    wait_until_idle(engine)
    time.sleep(0.15)
    snap = _snap(url)
    stats, tree = snap["stats"], snap["tree"]
    assert set(stats) == set(engine.stats()) and stats["num_running"] == stats["num_waiting"] == 0
    assert 0.3 < stats["cache_hit_rate"] < 1
    assert tree["cached_pages"] == stats["kv_pages_cached"] > 0
    assert tree["evictable_pages"] == stats["kv_pages_evictable"] and tree["protected_pages"] == 0
    root, *nodes = tree["nodes"]
    assert root["parent"] is None and root["subtree_tokens"] == tree["num_tokens"]
    prefix_nodes = [n for n in nodes if n["depth"] == 1 and n["hits"]]
    assert len(prefix_nodes) >= 2  # each shared prefix was matched by its later prompts
    assert all("text" not in n for n in nodes)
    assert all(n["last_use_s"] is not None and n["last_use_s"] < 60 for n in prefix_nodes)

    finished = snap["requests"]["finished"]
    labels = {r["label"] for r in finished}
    assert {"generate", "chat", "completions", "program:qa"} <= labels
    assert all("prompt" not in r for r in finished)
    cached = [r for r in finished if r["label"] == "generate" and r["cached_tokens"]]
    assert cached and all(r["finish_reason"] == "length" for r in cached)

    rows = _snap(url, since=0)["history"]
    assert rows and {
        "window_hit_rate",
        "output_tokens_per_s",
        "prefill_tokens_per_step",
        "ttft_p50_s",
        "kv_pages_free",
    } <= set(rows[-1])
    assert any(r["prefill_tokens"] for r in rows) and any(r["decode_tokens"] for r in rows)
    assert any(r["ttft_p50_s"] for r in rows)
    last = rows[-1]["seq"]
    time.sleep(0.15)
    newer = _snap(url, since=last)["history"]
    assert newer and all(r["seq"] > last for r in newer)
    assert snap["steps"] and {"prefill", "decode", "verify", "jump_forward"} <= set(
        snap["steps"][0]
    )


def test_probe_comes_off_when_nobody_watches(server):
    _snap(server.url)
    assert _watched(server.engine)
    wait_for(lambda: not _watched(server.engine), timeout=8, what="the probe to come off")
    send(server.url, shared_prefix_prompts(1, 1))  # the engine steps with no subscriber
    assert _snap(server.url)["watch"]["probe_installed"]


def test_plait_top_prints_one_screen(server, capsys):
    from plait.cli import main
    from plait.server.top import spark

    send(server.url, shared_prefix_prompts(1, 2))
    assert main(["top", "--once", "--url", server.url]) == 0
    screen = capsys.readouterr().out
    lines = screen.splitlines()
    assert lines[0].startswith("plait top  " + server.url)
    assert any(line.startswith("KV pool   [") for line in lines)
    assert "radix tree (largest branches)" in lines and any(" tok " in line for line in lines)
    assert any(line.startswith("requests: ") for line in lines)
    assert spark([0, 1, None, 2], 6) == "  ▁▅ █"


def test_prompts_shown_only_when_allowed(tiny_engine):
    from plait.server.app import create_app
    from plait.server.dashboard import DashboardConfig
    from plait.server.launch import ServerThread

    app = create_app(tiny_engine, dashboard=DashboardConfig(show_prompts=True))
    with ServerThread(app) as srv:
        send(srv.url, ["The secret word is pineapple."])
        snap = _snap(srv.url)
    assert snap["show_prompts"]
    mine = [r for r in snap["requests"]["finished"] if "pineapple" in r.get("prompt", "")]
    assert mine and mine[0]["label"] == "generate"
    assert any("text" in n for n in snap["tree"]["nodes"][1:])


def test_snapshot_obeys_the_api_key(tiny_llama_dir):
    with tiny_server(tiny_llama_dir, api_key="sk-dash") as srv:
        assert httpx.get(srv.url + "/dashboard/snapshot").status_code == 401
        page = httpx.get(srv.url + "/dashboard")
        assert page.status_code == 200 and 'data-panel="radix-tree"' in page.text
        assert (
            "sk-dash" not in page.text
            and "http://" not in page.text.split("<body")[1].split("</footer>")[0]
        )
        ok = httpx.get(srv.url + "/dashboard/snapshot", headers={"Authorization": "Bearer sk-dash"})
        assert ok.status_code == 200 and ok.json()["kind"] == "server"
        assert (
            "/dashboard/snapshot"
            in httpx.get(
                srv.url + "/openapi.json", headers={"Authorization": "Bearer sk-dash"}
            ).json()["paths"]
        )
        assert (
            httpx.get(
                srv.url + "/dashboard/snapshot?nodes=0", headers={"Authorization": "Bearer sk-dash"}
            ).status_code
            == 400
        )


def test_router_has_a_view_per_replica(tiny_llama_dir):
    from plait.server.launch import ServerThread
    from plait.server.router_app import create_router_app
    from plait.server.routing import RouterConfig

    with tiny_server(tiny_llama_dir) as a, tiny_server(tiny_llama_dir) as b:
        app = create_router_app([a.url, b.url], RouterConfig(health_interval=0.2))
        try:
            with ServerThread(app) as router:
                assert 'data-panel="replicas"' in httpx.get(router.url + "/dashboard").text
                send(router.url, shared_prefix_prompts(num_prefixes=2, per_prefix=2))
                views = [_snap(router.url, replica=i) for i in (0, 1)]
                assert [v["router"]["selected"] for v in views] == [0, 1]
                assert len(views[0]["router"]["replicas"]) == 2
                served = [len(v["requests"]["finished"]) for v in views]
                assert sum(served) >= 4
                mine = {r["rid"] for r in views[0]["requests"]["finished"]}
                assert not mine & {r["rid"] for r in views[1]["requests"]["finished"]}
                assert views[0]["stats"]["kv_pages_cached"] == a.engine.stats()["kv_pages_cached"]
                a.stop()
                down = _snap(router.url, replica=0)
                assert "error" in down and down["router"]["selected"] == 0
        finally:
            app.state.router.close()
