"""Each KV tier in `/metrics`, `Engine.stats()` and the dashboard, on a real server."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.browser_support import ensure_browser, headless_chromium
from tests.integration.dashboard_support import wait_for
from tests.integration.server_support import tiny_server, wait_until_idle
from tests.integration.test_kv_disk_tier import prompt, wait_written


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv-disk")
    with tiny_server(tiny_llama_dir, {"kv_disk": str(disk)}) as srv:
        body = {"input_ids": prompt(0), "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(srv.url + "/generate", json=body, timeout=60).status_code == 200
        wait_written(srv.engine)
        srv.engine.flush_cache()  # the next one comes back from disk
        assert httpx.post(srv.url + "/generate", json=body, timeout=60).status_code == 200
        wait_until_idle(srv.engine)
        yield srv


def test_metrics_name_each_tier(server):
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for line in (
        'plait_kv_tier_blocks{tier="disk"} 4.0',
        'plait_kv_tier_demotions{tier="disk"} 4.0',
        'plait_kv_tier_promotions{tier="disk"} 4.0',
        'plait_kv_tier_hit_rate{tier="disk"} 0.5',  # 4 lookups missed, then 4 hit
        'plait_kv_tier_failures{tier="disk"} 0.0',
        'plait_kv_tier_failures_by_kind{kind="corrupt",tier="disk"} 0.0',
    ):
        assert line in text
    assert "plait_kv_tier_load_seconds_mean" in text
    stats = server.engine.stats()
    assert stats["kv_tiers"] == "disk" and stats["kv_disk_bytes"] > 4 * 64 * 512


def test_dashboard_shows_each_tier(server):
    snap = httpx.get(server.url + "/dashboard/snapshot", timeout=30).json()
    assert snap["stats"]["kv_disk_promotions"] == 4
    found = ensure_browser()
    if isinstance(found, str):
        pytest.skip(f"no headless browser for the dashboard tests: {found}")
    read = """
        const panel = document.querySelector('[data-panel="kv-tiers"]');
        const row = document.querySelector('[data-table="tiers"] tr[data-tier="disk"]');
        return {hidden: panel.hidden, cells: row ? [...row.cells].map(c => c.textContent) : null};
    """
    with headless_chromium(found) as driver:
        driver.get(server.url + "/dashboard")
        wait_for(lambda: driver.execute_script(read)["cells"] is not None, what="the tiers table")
        page = driver.execute_script(read)
    assert not page["hidden"]
    tier, blocks, _, hit_rate, promotions, demotions, _, failures = page["cells"]
    assert (tier, blocks, hit_rate, promotions, demotions, failures) == (
        "disk",
        "4",
        "50.0%",
        "4",
        "4",
        "0",
    )
