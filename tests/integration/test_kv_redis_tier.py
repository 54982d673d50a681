"""The Redis tier against a real redis-server: engines sharing a prefix, Redis gone or slow."""

from __future__ import annotations

import threading

import pytest

from plait import Engine
from tests.integration.redis_support import RedisServer
from tests.integration.test_kv_disk_tier import BLOCK, engine_kwargs, prompt, run, wait_written


@pytest.fixture()
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cold(tiny_llama_dir) -> dict[int, list[int]]:
    with Engine(**engine_kwargs(tiny_llama_dir)) as engine:
        return {seed: run(engine, prompt(seed))[0] for seed in range(3)}


def test_two_engines_share_a_prefix_through_redis(tiny_llama_dir, tmp_path, redis_server, cold):
    kwargs = engine_kwargs(tiny_llama_dir, kv_redis=redis_server.url)
    with Engine(**kwargs) as first, Engine(**kwargs, kv_disk=str(tmp_path / "disk")) as second:
        assert run(first, prompt(0)) == (cold[0], 0)
        assert wait_written(first)["kv_redis_demotions"] == 4
        assert len(redis_server.client.keys(b"plait:kv:*")) == 4
        assert run(second, prompt(0)) == (cold[0], 4 * BLOCK)  # computed by the first
        stats = wait_written(second)
    assert stats["kv_redis_promotions"] == 4 and stats["kv_redis_failures"] == 0
    assert stats["kv_disk_lookups"] == 4 and stats["kv_disk_hits"] == 0
    # what Redis supplied is now on the second engine's disk too
    with Engine(**engine_kwargs(tiny_llama_dir, kv_disk=str(tmp_path / "disk"))) as third:
        assert run(third, prompt(0)) == (cold[0], 4 * BLOCK)


def test_redis_gone_or_slow_is_a_miss(tiny_llama_dir, redis_server, cold):
    with Engine(**engine_kwargs(tiny_llama_dir, kv_redis=redis_server.url)) as engine:
        assert run(engine, prompt(0)) == (cold[0], 0)
        wait_written(engine)
        engine.flush_cache()
        # slow: the server answers nobody for 3 s; the request does not wait for it
        pause = threading.Thread(target=redis_server.client.client_pause, args=(3000,))
        pause.start()
        pause.join()
        assert run(engine, prompt(0)) == (cold[0], 0)
        slow = engine.stats()
        assert slow["kv_tiers_late_loads"] + slow["kv_redis_failures_timeout"] >= 1
        # gone: the server is stopped
        redis_server.stop()
        engine.flush_cache()
        for seed in (0, 1, 2):
            assert run(engine, prompt(seed)) == (cold[seed], 0)
        gone = wait_written(engine)
    assert gone["kv_redis_failures_unavailable"] + gone["kv_redis_failures_timeout"] >= 2
    assert gone["kv_redis_promotions"] == 0
