"""Fuzzing: every operation of the server's own OpenAPI schema with schemathesis (valid and
invalid bodies), hostile body shapes for the generation routes with hypothesis (every field
absent, plausible or any JSON value at all), and constraint compilation with hypothesis
(pathological regexes and schemas). A crash is a 5xx other than 503/504, a hang past the
client's timeout, a 400 that does not name its field, or a stream without a terminal event; the
server must be healthy and leak nothing afterwards."""

from __future__ import annotations

import json
import time
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from tests.reliability.report import Tally, check_leaks, count_status, rss_mb

CLIENT_TIMEOUT = 60.0


def fuzz_http(server: Any, examples: int, seed: int | None = None) -> Tally:
    """`seed`: None replays the same cases every run (derandomized); an int draws others."""
    import requests
    import schemathesis

    tally = Tally("fuzz-http")
    start = time.perf_counter()
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in modes:
            test = given(operation.as_strategy(generation_mode=mode))(
                lambda case: _call(case, server.url, tally, requests)
            )
            if seed is not None:
                test = hypothesis_seed(seed)(test)
            run = settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=seed is None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(test)
            try:
                run()
            except Exception as e:  # hypothesis gives up on unsatisfiable (parameterless) modes
                if type(e).__name__ not in ("Unsatisfiable", "FailedHealthCheck"):
                    tally.crashes += 1
                    tally.note(f"{operation.method} {operation.path}: {type(e).__name__}: {e}")
    check_leaks(tally, server)
    tally.seconds = time.perf_counter() - start
    return tally


def _call(case: Any, url: str, tally: Tally, requests: Any) -> None:
    tally.fuzz_cases += 1
    began = time.perf_counter()
    try:
        response = case.call(base_url=url, timeout=CLIENT_TIMEOUT)
    except requests.RequestException as e:
        tally.sent += 1
        tally.crashes += 1
        tally.note(f"{case.method} {case.path} {_shown(case.body)}: {type(e).__name__}")
        return
    took = time.perf_counter() - began
    tally.extra["slowest_case_s"] = max(tally.extra.get("slowest_case_s", 0.0), took)
    status = response.status_code
    program_failed = status == 500 and '"program_error"' in response.text  # `fail` raises
    count_status(tally, status, expected_failure=program_failed)
    if status >= 500 and status not in (503, 504) and not program_failed:
        tally.note(
            f"{case.method} {case.path} {_shown(case.body)} -> {status} {response.text[:200]}"
        )
    if status == 200 and "text/event-stream" in response.headers.get("content-type", ""):
        lines = [x for x in response.text.splitlines() if x.startswith("data:")]
        if not lines or lines[-1].strip() != "data: [DONE]":
            tally.lost += 1
            tally.note(f"stream without [DONE]: {_shown(case.body)}")


# Sent first by every body fuzz: shapes that once got a 500 instead of a 400 naming the field.
KNOWN_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/generate", {"input_ids": {"": None}, "text": None}),
    ("/generate", {"input_ids": {"": None}, "stream": True}),
    ("/generate", {"input_ids": 5}),
    ("/generate", {"text": "a", "sampling_params": {"stop": 5}}),
    ("/generate", {"text": "a", "sampling_params": [{"stop_token_ids": 1.5}]}),
    ("/generate", {"text": "a", "sampling_params": {"stop_token_ids": [10**30]}}),
    (
        "/generate",
        {
            "text": "a",
            "sampling_params": {
                "stop_token_ids": [60000],
                "min_new_tokens": 2,
                "max_new_tokens": 3,
            },
        },
    ),
    ("/abort_request", {"abort_all": {"": None}}),
]


def fuzz_bodies(server: Any, examples: int, seed: int | None = None) -> Tally:
    """`examples` hypothesis bodies for each of /generate, /v1/completions and
    /v1/chat/completions (tests/reliability/strategies.py), after `KNOWN_BODIES`. Every answer
    must be a 200 or a 4xx whose error names its field (`param`, repeated in the message)."""
    import httpx

    from tests.reliability.strategies import chat_bodies, completion_bodies, generate_bodies

    tally = Tally("fuzz-bodies")
    start = time.perf_counter()
    limits = httpx.Limits(max_keepalive_connections=0)  # a crash must not cost the next case
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT, limits=limits) as client:
        for path, body in KNOWN_BODIES:
            _post_body(client, path, body, tally)
        for path, bodies in (
            ("/generate", generate_bodies()),
            ("/v1/completions", completion_bodies()),
            ("/v1/chat/completions", chat_bodies()),
        ):
            test = given(bodies)(_body_sender(client, path, tally))
            if seed is not None:
                test = hypothesis_seed(seed)(test)
            settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=seed is None,
                suppress_health_check=list(HealthCheck),
            )(test)()
    check_leaks(tally, server)
    tally.seconds = time.perf_counter() - start
    return tally


def _body_sender(client: Any, path: str, tally: Tally) -> Any:
    def send(body: dict[str, Any]) -> None:
        _post_body(client, path, body, tally)

    return send


def _post_body(client: Any, path: str, body: dict[str, Any], tally: Tally) -> None:
    import httpx

    tally.fuzz_cases += 1
    raw = json.dumps(body)  # lone surrogates travel as \ud800 escapes, as JSON allows
    try:
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
    except httpx.HTTPError as e:
        tally.sent += 1
        tally.crashes += 1
        tally.note(f"{path} {_shown(body)}: {type(e).__name__}")
        return
    status = r.status_code
    count_status(tally, status)
    if status >= 500 and status not in (503, 504):
        tally.note(f"{path} {_shown(body)} -> {status} {r.text[:200]}")
    elif 400 <= status < 500:
        try:
            error = r.json()["error"]
            param, message = error["param"], error["message"]
        except (ValueError, KeyError, TypeError):
            param, message = None, r.text
        if param is None or param.split(".")[0] not in message:
            tally.crashes += 1
            tally.note(f"{path} {_shown(body)} -> {status} naming no field: {message[:200]}")
    elif "text/event-stream" in r.headers.get("content-type", ""):
        lines = [x for x in r.text.splitlines() if x.startswith("data:")]
        if not lines or lines[-1].strip() != "data: [DONE]":
            tally.lost += 1
            tally.note(f"stream without [DONE]: {path} {_shown(body)}")


def _shown(body: Any) -> str:
    try:
        return json.dumps(body, default=str)[:300]
    except (TypeError, ValueError):
        return repr(body)[:300]


def fuzz_constraints(engine: Any, examples: int, budget_s: float, rss_limit_mb: float) -> Tally:
    """Compiles hostile regexes and schemas on the engine's grammar backend: each is compiled
    or rejected with a GrammarError (a 400 on the server), within the compile timeout; the
    process grows by at most `rss_limit_mb` (refused and timed-out grammars give theirs back,
    the cache holds a bounded number of compiled ones)."""
    from plait.runtime.constrained import GrammarError, make_grammar_key
    from tests.reliability.strategies import regexes, schemas

    tally = Tally("fuzz-constraints")
    start = time.perf_counter()
    before = rss_mb()
    cache = engine._grammar_cache()
    limit = engine.config.grammar_compile_timeout
    worst = 0.0

    def compile_one(kind: str, value: Any) -> None:
        nonlocal worst
        if time.perf_counter() - start > budget_s:
            return
        tally.fuzz_cases += 1
        tally.sent += 1
        began = time.perf_counter()
        try:
            key = make_grammar_key(**{kind: value})
            cache.get(key, timeout=limit)
            tally.completed += 1
        except (GrammarError, TimeoutError):
            tally.refused += 1
        except Exception as e:
            tally.crashes += 1
            tally.note(f"{kind} {_shown(value)}: {type(e).__name__}: {e}")
        worst = max(worst, time.perf_counter() - began)

    common = dict(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    settings(**common)(given(regexes())(lambda r: compile_one("regex", r)))()
    settings(**common)(given(schemas())(lambda s: compile_one("json_schema", json.dumps(s))))()
    settings(**common)(
        given(st.text(alphabet="()[]{}*+?|\\^$.,0123456789ab-", max_size=120))(
            lambda r: compile_one("regex", r)
        )
    )()
    tally.extra["slowest_compile_s"] = round(worst, 2)
    growth = rss_mb() - before
    tally.extra["rss_growth_mb"] = round(growth, 1)
    if growth > rss_limit_mb:
        tally.leaks += 1
        tally.note(
            f"resident memory grew {growth:.0f} MB compiling constraints "
            f"(limit {rss_limit_mb:g} MB)"
        )
    tally.seconds = time.perf_counter() - start
    return tally
