"""The router's health monitor without replicas' processes: a mock transport answers its probes."""

from __future__ import annotations

import logging
import time

import httpx

from plait.server.prefix_tree import PrefixTree
from plait.server.replica_health import HealthMonitor
from plait.server.router_metrics import RouterMetrics
from plait.server.routing import Replica, Router, RouterConfig


class _Exited:
    """A `ServerProcess` stand-in whose process has exited."""

    class process:  # noqa: N801 - mirrors ServerProcess.process (a Popen)
        @staticmethod
        def poll() -> int:
            return -9


def _router(*urls: str) -> Router:
    return Router(RouterConfig(), [Replica(u, PrefixTree()) for u in urls])


def _client(handler) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def test_refused_probe_marks_down_and_a_passing_one_brings_it_back():
    router = _router("http://a", "http://b")
    a, b = router.replicas
    monitor = HealthMonitor(router)
    state = {"up": False}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a" and not state["up"]:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200)

    with _client(handler) as client:
        monitor.probe(client, a)
        monitor.probe(client, b)
        assert not a.healthy and a.downs == 1 and "ConnectError" in a.last_error
        assert b.healthy and [r.url for r in router.healthy()] == ["http://b"]
        metrics = RouterMetrics(router).render().decode()
        assert 'plait_router_replica_up{replica="http://a"} 0.0' in metrics
        assert 'plait_router_replica_downs_total{replica="http://a"} 1.0' in metrics
        assert router.choose("x").replica is b  # traffic avoids it
        state["up"] = True
        monitor.probe(client, a)
        assert a.healthy and a.downs == 1
        assert {router.choose(f"{i}").replica.url for i in range(4)} == {"http://a", "http://b"}


def test_a_slow_or_failing_health_needs_two_misses():
    router = _router("http://a")
    (a,) = router.replicas
    monitor = HealthMonitor(router)
    with _client(lambda request: httpx.Response(500)) as client:
        monitor.probe(client, a)
        assert a.healthy
        monitor.probe(client, a)
        assert not a.healthy and a.last_error == "/health did not answer 200"


def test_a_stale_probe_does_not_revive_a_replica_that_failed_meanwhile():
    router = _router("http://a")
    (a,) = router.replicas

    def handler(request: httpx.Request) -> httpx.Response:
        # while this probe is on its way, a forward to the replica fails and marks it down
        router.mark_down(a, "RemoteProtocolError: Server disconnected")
        return httpx.Response(200)

    with _client(handler) as client:
        HealthMonitor(router).probe(client, a)
    assert not a.healthy and a.downs == 1
    with _client(lambda request: httpx.Response(200)) as client:
        HealthMonitor(router).probe(client, a)  # a fresh probe that passes: back again
    assert a.healthy


def test_an_exited_process_is_down_for_good():
    router = _router("http://a")
    (a,) = router.replicas
    a.process = _Exited()
    monitor = HealthMonitor(router)
    with _client(
        lambda request: httpx.Response(200)
    ) as client:  # e.g. another server took the port
        for _ in range(3):
            monitor.probe(client, a)
    assert not a.healthy and a.downs == 1 and a.last_error == "its process exited with code -9"


def test_the_monitor_thread_outlives_a_probe_that_raises(caplog):
    router = Router(RouterConfig(health_interval=0.01), [Replica("http://a", PrefixTree())])
    (a,) = router.replicas

    class Broken:
        class process:  # noqa: N801
            @staticmethod
            def poll() -> int:
                raise OSError("poll failed")

    a.process = Broken()
    monitor = HealthMonitor(router)
    with caplog.at_level(logging.ERROR, logger="plait.router"):
        monitor.start()
        try:
            deadline = time.monotonic() + 10
            while sum("probing replica" in r.message for r in caplog.records) < 2:
                assert time.monotonic() < deadline, "the monitor stopped probing"
                time.sleep(0.01)
            assert monitor._thread.is_alive()
            a.process = _Exited()
            while a.healthy:
                assert time.monotonic() < deadline, "the monitor did not notice the exit"
                time.sleep(0.01)
        finally:
            monitor.stop()
