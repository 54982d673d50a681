"""`/dashboard` in a real headless chromium against a real server on loopback: after traffic with
shared prefixes, what the page shows (hit rate, cached pages, tree nodes, running and waiting
requests) matches `/dashboard/snapshot`, and it follows the server as that changes. Writes a
screenshot to bench-results/screenshots/ (docs/dashboard.md shows one)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import write_tiny_checkpoint
from tests.integration.browser_support import ensure_browser, headless_chromium
from tests.integration.dashboard_support import long_streams, send, shared_prefix_prompts, wait_for
from tests.integration.server_support import tiny_server, wait_until_idle

ARTIFACTS = Path(__file__).resolve().parents[2] / "bench-results" / "screenshots"
KEY = "sk-dashboard"

READ_PAGE = """
const metrics = {};
for (const el of document.querySelectorAll("[data-metric]")) metrics[el.dataset.metric] = el.dataset.value;
const ids = [...document.querySelectorAll('[data-chart="tree"] [data-node-id]')].map(e => +e.dataset.nodeId);
const count = (name) => +(document.querySelector('[data-table="' + name + '"]').dataset.count || 0);
return {metrics, ids, updates: +document.body.dataset.updates, state: document.body.dataset.state,
        live: count("live"), finished: count("finished"),
        choices: Object.fromEntries([...document.querySelectorAll('[data-table="execution"] [data-choice]')]
                                    .map(tr => [tr.dataset.choice, tr.cells[1].textContent])),
        panels: [...document.querySelectorAll("[data-panel]")].map(e => e.dataset.panel),
        series: [...document.querySelectorAll("[data-series]")].map(e => e.dataset.series)};
"""  # noqa: E501


@pytest.fixture(scope="module")
def browser():
    found = ensure_browser()
    if isinstance(found, str):
        pytest.skip(f"no headless browser for the dashboard tests: {found}")
    return found


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory, smollm_tokenizer):
    """The tiny model with a 16k context: streams that run long enough to be watched."""
    path = tmp_path_factory.mktemp("tiny-llama-16k")
    return write_tiny_checkpoint(path, "llama", smollm_tokenizer, max_position_embeddings=16384)


@pytest.fixture(scope="module")
def server(long_context_dir):
    engine_args = {
        "max_total_tokens": 40000,
        "max_running_requests": 2,
        "num_continuous_decode_steps": 1,
    }
    name = "tiny-llama-16k (random weights)"
    with tiny_server(long_context_dir, engine_args, api_key=KEY, served_model_name=name) as srv:
        yield srv


def _snapshot(url: str) -> dict:
    r = httpx.get(
        url + "/dashboard/snapshot", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    return r.json()


def _page(driver) -> dict:
    return driver.execute_script(READ_PAGE)


def test_page_matches_the_snapshot_and_follows_the_server(server, browser):
    auth = {"Authorization": f"Bearer {KEY}"}
    with headless_chromium(browser) as driver:
        driver.get(server.url + f"/dashboard#key={KEY}")
        wait_for(lambda: _page(driver)["updates"] >= 1, what="the page's first snapshot")
        send(server.url, shared_prefix_prompts(), headers=auth)  # watched: hits are counted
        wait_until_idle(server.engine)
        wait_for(lambda: _page(driver)["updates"] >= 3, what="the page's next snapshots")
        page = _page(driver)
        assert set(page["panels"]) >= {
            "summary",
            "radix-tree",
            "kv-pool",
            "batches",
            "latency",
            "execution",
            "requests",
        }
        assert {"kv_pages_free", "num_running", "ttft_p50_s", "prefill_tokens_per_step"} <= set(
            page["series"]
        )
        assert "key=" not in driver.current_url  # the key left the address bar
        fetched = driver.execute_script(
            'return performance.getEntriesByType("resource").map(e => e.name)'
        )
        assert fetched and all(u.startswith(server.url + "/dashboard/snapshot") for u in fetched)

        # idle: the page's figures are the snapshot's
        snap = _snapshot(server.url)
        stats = snap["stats"]
        assert any(n["hits"] for n in snap["tree"]["nodes"][1:])
        seen = _page(driver)["updates"]
        wait_for(lambda: _page(driver)["updates"] > seen, what="a snapshot after the last change")
        page = _page(driver)
        metrics = page["metrics"]
        assert stats["cache_hit_rate"] > 0.3
        assert float(metrics["cache_hit_rate"]) == pytest.approx(stats["cache_hit_rate"])
        for key in (
            "kv_pages_cached",
            "kv_pages_evictable",
            "kv_pages_free",
            "num_running",
            "num_waiting",
            "kv_pages_in_use",
        ):
            assert int(metrics[key]) == stats[key], key
        assert int(metrics["tree_nodes"]) == snap["tree"]["num_nodes"]
        # the execution the engine chose, as its stats say
        assert page["choices"] == {
            k.removeprefix("execution_"): str(v) for k, v in stats.items() if "execution_" in k
        }
        assert page["choices"]["layer_ops"] == "native" and "batch_invariant" in page["choices"]
        assert sorted(page["ids"]) == sorted(n["id"] for n in snap["tree"]["nodes"])
        assert page["finished"] >= len(shared_prefix_prompts())

        # more traffic: new prefixes change the tree and the hit rate; the page follows
        before = float(metrics["cache_hit_rate"])
        send(server.url, shared_prefix_prompts(num_prefixes=3, per_prefix=1)[2:], headers=auth)
        wait_until_idle(server.engine)
        after = _snapshot(server.url)
        assert after["stats"]["cache_hit_rate"] != pytest.approx(before)

        def caught_up() -> bool:
            now = _page(driver)
            return float(now["metrics"]["cache_hit_rate"]) == pytest.approx(
                after["stats"]["cache_hit_rate"]
            ) and sorted(now["ids"]) == sorted(n["id"] for n in after["tree"]["nodes"])

        wait_for(caught_up, what="the page to show the new tree and hit rate")

        # four long streams, two running at a time: the page shows two running and two waiting
        with long_streams(server.url, 4, max_new_tokens=15000, headers=auth):
            wait_for(
                lambda: (
                    _snapshot(server.url)["stats"]["num_running"] == 2
                    and _snapshot(server.url)["stats"]["num_waiting"] == 2
                ),
                what="2 running, 2 waiting",
            )

            def shows_load() -> bool:
                m = _page(driver)["metrics"]
                return (
                    m["num_running"] == "2"
                    and m["num_waiting"] == "2"
                    and m["decode_tokens_per_step"] not in ("", "0")
                )

            wait_for(shows_load, what="the page to show 2 running and 2 waiting")
            wait_for(lambda: _page(driver)["live"] == 4, what="4 live requests in the table")
            seen = _page(driver)["updates"]
            wait_for(lambda: _page(driver)["updates"] >= seen + 5, what="a few seconds of history")
            live = _snapshot(server.url)["requests"]["live"]
            assert sorted(r["status"] for r in live) == ["decode", "decode", "waiting", "waiting"]
            assert all(r["label"] == "generate" and "prompt" not in r for r in live)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shot = ARTIFACTS / "dashboard.png"
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(1400, height + 140)  # the whole page in one picture
            wait_for(lambda: _page(driver)["updates"] >= 3, what="a redraw at the new size")
            driver.save_screenshot(str(shot))
            assert shot.stat().st_size > 10_000
            (ARTIFACTS / "dashboard-snapshot.json").write_text(
                json.dumps(_snapshot(server.url), indent=1)
            )
        wait_until_idle(server.engine, timeout=30)
        wait_for(
            lambda: _page(driver)["metrics"]["num_running"] == "0", what="the page to show idle"
        )


def test_page_asks_for_the_key_and_data_needs_it(server, browser):
    assert httpx.get(server.url + "/dashboard/snapshot").status_code == 401
    assert httpx.get(server.url + "/dashboard").status_code == 200  # the static page, no data
    with headless_chromium(browser) as driver:
        driver.get(server.url + "/dashboard")
        wait_for(
            lambda: driver.execute_script(
                "return !document.querySelector('[data-field=\"auth\"]').hidden"
            ),
            what="the key form",
        )
        assert _page(driver)["updates"] == 0
        field = driver.find_element("css selector", '[data-field="auth"] input[name="key"]')
        field.send_keys(KEY)
        driver.find_element("css selector", '[data-field="auth"] button').click()
        wait_for(lambda: _page(driver)["updates"] >= 1, what="the page after the key")
        assert _page(driver)["state"] == "live"


def test_router_page_has_a_view_per_replica(tiny_llama_dir, browser):
    from plait.server.launch import ServerThread
    from plait.server.router_app import create_router_app
    from plait.server.routing import RouterConfig

    with tiny_server(tiny_llama_dir) as a, tiny_server(tiny_llama_dir) as b:
        send(
            a.url, shared_prefix_prompts(num_prefixes=1, per_prefix=2)
        )  # only replica 0 has a tree
        app = create_router_app([a.url, b.url], RouterConfig(health_interval=0.2))
        try:
            with ServerThread(app) as router, headless_chromium(browser) as driver:
                driver.get(router.url + "/dashboard")
                wait_for(lambda: _page(driver)["updates"] >= 1, what="the router's page")
                buttons = driver.find_elements("css selector", '[data-panel="replicas"] button')
                assert [x.get_attribute("data-replica") for x in buttons] == ["0", "1"]
                assert buttons[0].get_attribute("aria-pressed") == "true"
                cached = a.engine.stats()["kv_pages_cached"]
                assert cached > 0 and b.engine.stats()["kv_pages_cached"] == 0
                wait_for(
                    lambda: _page(driver)["metrics"]["kv_pages_cached"] == str(cached),
                    what="replica 0's cache on the page",
                )
                buttons[1].click()
                wait_for(
                    lambda: (
                        _page(driver)["metrics"]["kv_pages_cached"] == "0"
                        and not _page(driver)["ids"][1:]
                    ),
                    what="replica 1's empty tree",
                )
                pressed = driver.find_element(
                    "css selector", '[data-panel="replicas"] button[aria-pressed="true"]'
                )
                assert pressed.get_attribute("data-replica") == "1"
        finally:
            app.state.router.close()
