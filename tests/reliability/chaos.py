"""Chaos: client disconnects at random moments, aborts by rid, an exception injected into the
forward pass or the grammar compile of one request, KV pool exhaustion. After each, the faulty
request failed alone (500 with a message), the others match their outputs run alone, no page
leaked, and the server answers /health_generate."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from typing import Any

import httpx

from tests.reliability.report import Tally, check_leaks, count_status

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 400, "ignore_eos": True}


async def _stream(c: httpx.AsyncClient, body: dict) -> list[str]:
    async with c.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            return [f"status {r.status_code}"]
        return [line async for line in r.aiter_lines() if line.startswith("data:")]


def disconnects(server: Any, count: int, seed: int = 0) -> Tally:
    """`count` requests (2/3 streamed) each cut off at a random moment, or left to finish."""
    tally = Tally("chaos-disconnects")
    rng = random.Random(seed)
    start = time.perf_counter()

    async def one(c: httpx.AsyncClient, i: int) -> None:
        stream = i % 3 != 0
        body = {
            "text": f"story {i}",
            "sampling_params": {**LONG, "max_new_tokens": rng.randint(4, 400)},
            "stream": stream,
        }
        cut = rng.uniform(0.0, 3.0)
        tally.sent += 1
        try:
            if stream:
                lines = await asyncio.wait_for(_stream(c, body), timeout=cut)
                done = bool(lines) and lines[-1].strip() == "data: [DONE]"
                tally.completed += done
                tally.lost += not done
            else:
                r = await asyncio.wait_for(c.post("/generate", json=body), timeout=cut)
                tally.sent -= 1
                count_status(tally, r.status_code)
        except asyncio.TimeoutError:
            tally.aborted += 1
        except httpx.HTTPError as e:
            tally.lost += 1
            tally.note(f"request {i}: {type(e).__name__}: {e}")

    async def main() -> None:
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
            await asyncio.gather(*(one(c, i) for i in range(count)))

    asyncio.run(main())
    check_leaks(tally, server)
    tally.seconds = time.perf_counter() - start
    return tally


def aborts(server: Any, count: int, seed: int = 0) -> Tally:
    """Streams aborted by rid through /abort_request end with an abort reason and [DONE]."""
    tally = Tally("chaos-aborts")
    rng = random.Random(seed)
    start = time.perf_counter()

    async def one(c: httpx.AsyncClient, i: int) -> None:
        rid = f"chaos-abort-{seed}-{i}"
        body = {"text": f"abort me {i}", "sampling_params": LONG, "stream": True, "rid": rid}
        task = asyncio.ensure_future(_stream(c, body))
        await asyncio.sleep(rng.uniform(0.05, 1.0))
        await c.post("/abort_request", json={"rid": rid})
        tally.sent += 1
        lines = await task
        if not lines or lines[-1].strip() != "data: [DONE]":
            tally.lost += 1
            return
        last = json.loads(lines[-2][5:]) if len(lines) > 1 else {}
        reason = (last.get("meta_info") or {}).get("finish_reason") or {}
        if reason.get("type") == "abort":
            tally.aborted += 1
        else:
            tally.completed += 1

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            await asyncio.gather(*(one(c, i) for i in range(count)))

    asyncio.run(main())
    check_leaks(tally, server)
    tally.seconds = time.perf_counter() - start
    return tally


@contextlib.contextmanager
def _patched(obj: Any, name: str, make: Any) -> Any:
    real = getattr(obj, name)
    setattr(obj, name, make(real))
    try:
        yield
    finally:
        setattr(obj, name, real)


def _poison_forward(real: Any) -> Any:
    def forward(batch: Any) -> Any:
        reqs = [e.req for e in batch.extends] + list(batch.decodes)
        if any("poison" in r.rid for r in reqs):
            raise RuntimeError("injected forward fault")
        return real(batch)

    return forward


def _poison_compile(real: Any) -> Any:
    def compile(key: Any) -> Any:
        if "poison" in key.pattern:
            raise RuntimeError("injected compile fault")
        return real(key)

    return compile


def faults(server: Any, rounds: int, width: int = 6) -> Tally:
    """Each round: `width` greedy requests alongside one whose forward pass (odd rounds) or
    grammar compile (even rounds) raises; only that one may fail, the others must match."""
    tally = Tally("chaos-faults")
    start = time.perf_counter()
    engine = server.engine
    backend = engine._grammar_cache().backend
    with httpx.Client(base_url=server.url, timeout=120) as c:
        prompts = [f"fault round prompt {i}" for i in range(width)]
        alone = [
            c.post("/generate", json={"text": p, "sampling_params": GREEDY}).json()["output_ids"]
            for p in prompts
        ]

    async def round_(i: int) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            if i % 2:
                bad = {"text": "bad", "sampling_params": GREEDY, "rid": f"poison-{i}"}
            else:
                bad = {"text": "bad", "sampling_params": {**GREEDY, "regex": f"poison{i}[0-9]+"}}
            calls = [
                c.post("/generate", json={"text": p, "sampling_params": GREEDY}) for p in prompts
            ]
            responses = await asyncio.gather(c.post("/generate", json=bad), *calls)
        count_status(tally, responses[0].status_code, expected_failure=True)
        if responses[0].status_code != 500 or "injected" not in responses[0].text:
            tally.crashes += 1
            tally.note(f"round {i}: the faulty request got {responses[0].status_code}")
        for want, r in zip(alone, responses[1:]):
            count_status(tally, r.status_code)
            if r.status_code == 200 and r.json()["output_ids"] != want:
                tally.crashes += 1
                tally.note(f"round {i}: a bystander's output changed")

    with (
        _patched(engine.core.runner, "forward", _poison_forward),
        _patched(backend, "compile", _poison_compile),
    ):
        for i in range(rounds):
            asyncio.run(round_(i))
    check_leaks(tally, server)
    tally.seconds = time.perf_counter() - start
    return tally


def pool_exhaustion(model: Any, count: int) -> Tally:
    """More concurrent work than the KV pool holds: requests are retracted and resumed, all
    finish, and their outputs equal those run alone."""
    from tests.reliability.serving import running_server

    tally = Tally("chaos-kv-exhaustion")
    start = time.perf_counter()
    sampling = {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}
    with running_server(model, {"max_total_tokens": 512, "max_running_requests": 16}) as server:
        with httpx.Client(base_url=server.url, timeout=300) as c:
            texts = [f"exhaust the pool, request {i}" for i in range(count)]
            r = c.post("/generate", json={"text": texts, "sampling_params": sampling})
            tally.sent += count
            outs = r.json() if r.status_code == 200 else []
            tally.completed += sum(
                o["meta_info"]["finish_reason"]["type"] == "length" for o in outs
            )
            tally.lost += count - len(outs)
            for i in (0, count - 1):
                alone = c.post("/generate", json={"text": texts[i], "sampling_params": sampling})
                if outs and alone.json()["output_ids"] != outs[i]["output_ids"]:
                    tally.crashes += 1
                    tally.note(f"request {i}: output differs after retraction")
        tally.extra["num_retracted"] = server.engine.stats()["num_retracted"]
        check_leaks(tally, server)
    tally.seconds = time.perf_counter() - start
    return tally
