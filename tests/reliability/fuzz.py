"""Fuzzing: every operation of the server's own OpenAPI schema with schemathesis (valid and
invalid bodies), and constraint compilation with hypothesis (pathological regexes and schemas).
A crash is a 5xx other than 503/504, a hang past the client's timeout, or a stream without a
terminal event; the server must be healthy and leak nothing afterwards."""

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
            run = settings(max_examples=examples, deadline=None, database=None,
                           derandomize=seed is None, phases=[Phase.explicit, Phase.generate],
                           suppress_health_check=list(HealthCheck))(test)  # fmt: skip
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
        tally.note(f"{case.method} {case.path} {_shown(case.body)} -> {status} {response.text[:200]}")
    if status == 200 and "text/event-stream" in response.headers.get("content-type", ""):
        lines = [x for x in response.text.splitlines() if x.startswith("data:")]
        if not lines or lines[-1].strip() != "data: [DONE]":
            tally.lost += 1
            tally.note(f"stream without [DONE]: {_shown(case.body)}")


def _shown(body: Any) -> str:
    try:
        return json.dumps(body, default=str)[:300]
    except (TypeError, ValueError):
        return repr(body)[:300]


def fuzz_constraints(engine: Any, examples: int, budget_s: float) -> Tally:
    """Compiles hostile regexes and schemas on the engine's grammar backend: each is compiled
    or rejected with a GrammarError (a 400 on the server), within the compile timeout."""
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

    common = dict(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
    settings(**common)(given(regexes())(lambda r: compile_one("regex", r)))()
    settings(**common)(given(schemas())(lambda s: compile_one("json_schema", json.dumps(s))))()
    settings(**common)(given(st.text(alphabet="()[]{}*+?|\\^$.,0123456789ab-", max_size=120))(
        lambda r: compile_one("regex", r)))()  # fmt: skip
    tally.extra["slowest_compile_s"] = round(worst, 2)
    tally.extra["rss_growth_mb"] = round(rss_mb() - before, 1)
    tally.seconds = time.perf_counter() - start
    return tally
