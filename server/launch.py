"""Starting a server: in this process (a uvicorn thread, for tests and notebooks) or as a
`plait serve` subprocess; both return once `/health` answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_health(
    url: str, timeout: float = 120.0, process: subprocess.Popen | None = None
) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"server exited with code {process.returncode} before it was healthy"
            )
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{url}/health did not answer within {timeout:.0f} s (last error: {last})")


class ServerThread:
    """`with ServerThread(app) as server: server.url` runs uvicorn in a daemon thread."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"
    ) -> None:
        import uvicorn

        from plait.server.limits import KEEP_ALIVE_SECONDS, UVICORN_HTTP

        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(
            app,
            host=host,
            port=self.port,
            log_level=log_level,
            http=UVICORN_HTTP,
            lifespan="off",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="plait-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess:
    """`plait serve ARGS` in a subprocess (`python -m plait.server.cli`, the same command);
    `stop()` terminates it, then kills it if needed. With `wait=False` it returns at once;
    `wait_healthy()` then waits (several replicas load their models side by side)."""

    def __init__(
        self,
        args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
        timeout: float = 300.0,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.timeout = timeout
        cmd = [
            sys.executable,
            "-m",
            "plait.server.cli",
            "--host",
            host,
            "--port",
            str(self.port),
            *args,
        ]
        self.process = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        try:
            wait_for_health(self.url, self.timeout, self.process)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(engine: Any, **config: Any) -> ServerThread:
    """Start a server for `engine` on a free loopback port; returns the running thread."""
    from plait.server.app import create_app
    from plait.server.state import ServerConfig

    log_level = config.pop("log_level", "warning")
    app = create_app(engine, ServerConfig(**config))
    host = config.get("host", "127.0.0.1")
    return ServerThread(
        app, host=host, port=config.get("port") or None, log_level=log_level
    ).start()
