"""`HealthMonitor`: a daemon thread that probes each replica's `/health` and marks it down or up.

A replica is down as soon as its process (when the router started it) has exited or a
connection is refused, and after two failed probes in a row otherwise (a busy replica may answer
slowly). A replica that answers again is routed to again, unless its process is gone. The
replicas are probed side by side each round, so one that hangs does not delay noticing another;
a probe that fails unexpectedly is logged and the monitor carries on.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from plait.server.routing import Replica, Router

logger = logging.getLogger("plait.router")


class HealthMonitor:
    def __init__(self, router: Router, headers: dict[str, str] | None = None) -> None:
        self.router = router
        self.headers = headers or {}
        self._misses: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="plait-router-health", daemon=True)

    def start(self) -> HealthMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        interval = self.router.config.health_interval
        workers = max(1, len(self.router.replicas))
        with (
            httpx.Client(timeout=max(2.0, 2 * interval), headers=self.headers) as client,
            ThreadPoolExecutor(workers, thread_name_prefix="plait-router-probe") as pool,
        ):
            while not self._stop.wait(interval):
                replicas = list(self.router.replicas)
                list(pool.map(lambda r: self._probe_logged(client, r), replicas))

    def _probe_logged(self, client: httpx.Client, replica: Replica) -> None:
        try:
            self.probe(client, replica)
        except Exception:  # a bug here must not end the monitoring of every replica
            logger.exception("probing replica %s failed", replica.url)

    def probe(self, client: httpx.Client, replica: Replica) -> None:
        if self._exited(replica):
            return
        failures = replica.failures
        try:
            ok = client.get(replica.url + "/health").status_code == 200
            error = "" if ok else "/health did not answer 200"
            refused = False
        except httpx.TransportError as e:
            ok, error, refused = (
                False,
                f"{type(e).__name__}: {e}",
                isinstance(e, httpx.ConnectError),
            )
        if self._exited(replica):  # it died while the probe was on its way
            return
        if ok:
            self._misses[replica.url] = 0
            if self.router.mark_up(replica, failures):
                logger.info("replica %s is healthy again", replica.url)
            return
        misses = self._misses.get(replica.url, 0) + 1
        self._misses[replica.url] = misses
        if replica.healthy and (refused or misses >= 2):
            self._down(replica, error)

    def _exited(self, replica: Replica) -> bool:
        process = replica.process
        code = process.process.poll() if process is not None else None
        if code is None:
            return False
        if replica.healthy or replica.last_error is None:
            self._down(replica, f"its process exited with code {code}")
        return True

    def _down(self, replica: Replica, error: str) -> None:
        if self.router.mark_down(replica, error):
            logger.warning("replica %s is down: %s", replica.url, error)
