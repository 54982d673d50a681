"""Traffic for the dashboard tests: prompts that share prefixes, and long streams held open."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

WORDS = "alpha beta gamma delta river stone cloud maple ember quartz violet harbor".split()


def shared_prefix_prompts(num_prefixes: int = 2, per_prefix: int = 3) -> list[str]:
    prefixes = [
        f"System {p}: " + " ".join(WORDS[(p + i) % len(WORDS)] for i in range(60))
        for p in range(num_prefixes)
    ]
    return [
        f"{pre}\nQuestion {q}: what is {WORDS[q % len(WORDS)]}?"
        for pre in prefixes
        for q in range(per_prefix)
    ]


def send(
    url: str, prompts: list[str], max_new_tokens: int = 6, headers: dict | None = None
) -> None:
    with httpx.Client(base_url=url, timeout=120, headers=headers or {}) as http:
        for prompt in prompts:
            body = {
                "text": prompt,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            }
            r = http.post("/generate", json=body)
            assert r.status_code == 200, r.text


@contextmanager
def long_streams(
    url: str, count: int, max_new_tokens: int, headers: dict | None = None
) -> Iterator[None]:
    """`count` streamed generations that run until the block ends (their clients then leave,
    which aborts them)."""
    stop = threading.Event()

    def one(i: int) -> None:
        body = {
            "text": f"Stream {i}: " + " ".join(WORDS),
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        }
        with httpx.Client(base_url=url, timeout=300, headers=headers or {}) as http:
            with http.stream("POST", "/generate", json=body) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)


def wait_for(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
