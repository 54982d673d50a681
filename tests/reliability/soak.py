"""Soak: measure the server's capacity (closed loop), then offer it `load`x that rate (Poisson
arrivals) for a bounded time, from one client flooding long prompts and several sending short
ones. Every request must complete, be refused (503) or time out (504); none is lost. Reports the
P50/P99 time to first token of admitted requests per kind, and memory before and after."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from tests.reliability.report import Tally, check_leaks, count_status, rss_mb

SHORT = {"max_new_tokens": 16, "ignore_eos": True}
LONG_PROMPT = "the flood of long prompts " * 40  # ~200 tokens
MAX_RSS_GROWTH_MB = 200  # "flat": the pool is preallocated; caches are bounded


def measure_capacity(server: Any, seconds: float, concurrency: int) -> float:
    """Completed short requests per second with `concurrency` clients sending back to back."""

    async def main() -> float:
        done = 0
        stop = 0.0

        async def worker(c: httpx.AsyncClient, w: int) -> None:
            nonlocal done
            i = 0
            while time.perf_counter() < stop:
                body = {"text": f"capacity probe {w} {i}", "sampling_params": SHORT}
                if (await c.post("/generate", json=body)).status_code == 200:
                    done += 1
                i += 1

        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            warm = {"text": "warm up", "sampling_params": SHORT}
            await asyncio.gather(*(c.post("/generate", json=warm) for _ in range(concurrency)))
            stop = time.perf_counter() + seconds
            start = time.perf_counter()
            await asyncio.gather(*(worker(c, w) for w in range(concurrency)))
        return done / (time.perf_counter() - start)

    return asyncio.run(main())


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def soak(server: Any, seconds: float, rate: float, timeout: float, seed: int = 0) -> Tally:
    """Offers `rate` requests/s for `seconds`; each request carries `timeout`."""
    tally = Tally("soak")
    rng = random.Random(seed)
    ttft: dict[str, list[float]] = {"short": [], "flood": []}
    before = rss_mb()
    start = time.perf_counter()

    async def one(c: httpx.AsyncClient, i: int) -> None:
        kind = "flood" if rng.random() < 0.25 else "short"
        text = LONG_PROMPT + str(i) if kind == "flood" else f"short question {i}"
        client = "flood" if kind == "flood" else f"user-{i % 8}"
        body = {"text": text, "sampling_params": SHORT, "stream": True, "timeout": timeout}
        sent = time.perf_counter()
        first = None
        try:
            async with c.stream(
                "POST", "/generate", json=body, headers={"X-Client-Id": client}
            ) as r:
                if r.status_code != 200:
                    await r.aread()
                    count_status(tally, r.status_code)
                    return
                last = previous = ""
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if first is None and '"completion_tokens": 0' not in line:
                        first = time.perf_counter() - sent
                    previous, last = last, line
        except httpx.HTTPError as e:
            tally.sent += 1
            tally.lost += 1
            tally.note(f"request {i}: {type(e).__name__}: {e}")
            return
        tally.sent += 1
        if last.strip() != "data: [DONE]":
            tally.lost += 1
        elif '"status_code": 504' in previous:
            tally.timed_out += 1
        elif '"type": "abort"' in previous:
            tally.crashes += 1  # nothing is injected here: any other abort is a failure
            tally.note(f"request {i}: {previous[:200]}")
        else:
            tally.completed += 1
            if first is not None:
                ttft[kind].append(first)

    async def main() -> None:
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=server.url, timeout=timeout + 60, limits=limits) as c:
            tasks = []
            t = time.perf_counter()
            end = t + seconds
            i = 0
            # NOTE: the wall clock ends it too: a client that falls behind the arrival schedule
            # (the server shares this process) offers less, rather than running long
            while t < end and time.perf_counter() < end:
                tasks.append(asyncio.ensure_future(one(c, i)))
                i += 1
                t += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, t - time.perf_counter()))
            await asyncio.gather(*tasks)

    asyncio.run(main())
    tally.seconds = time.perf_counter() - start
    check_leaks(tally, server)
    after = rss_mb()
    if after - before > MAX_RSS_GROWTH_MB:
        tally.leaks += 1
        tally.note(f"resident memory grew {after - before:.0f} MB during the soak")
    tally.extra.update(
        {
            "offered_rate": round(rate, 2),
            "sent_rate": round(tally.sent / seconds, 2),
            "ttft_p50_short_s": _percentile(ttft["short"], 0.5),
            "ttft_p99_short_s": _percentile(ttft["short"], 0.99),
            "ttft_p50_flood_s": _percentile(ttft["flood"], 0.5),
            "ttft_p99_flood_s": _percentile(ttft["flood"], 0.99),
            "rss_before_mb": round(before),
            "rss_after_mb": round(after),
        }
    )
    return tally
