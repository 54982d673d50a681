"""Hostile input: oversized bodies and headers, JSON bombs, pathological constraints, program
arguments, the API key check; the server answers each with a 4xx and stays healthy."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from plait.lang.program import program
from tests.integration.server_support import tiny_server, wait_until_idle

KEY = {"Authorization": "Bearer sk-hostile"}


@program
def echo(s, word: str, times: int = 1):
    s += word * times


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir, api_key="sk-hostile", max_body_bytes=64 << 10) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=KEY) as c:
        yield c


def gen(client, **sampling):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2, **sampling}}
    return client.post("/generate", json=body)


def test_body_over_the_limit_is_413(client):
    big = {"text": "a" * (70 << 10), "sampling_params": {"max_new_tokens": 1}}
    r = client.post("/generate", json=big)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"

    def chunks():  # no Content-Length: counted while read
        for _ in range(80):
            yield b"x" * 1024

    r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_json_bombs_are_400(client):
    for depth in (200, 30_000):
        raw = b'{"text": ' + b"[" * depth + b"]" * depth + b"}"
        r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body", depth
    deep = {"messages": [{"role": "user", "content": "x"}], "stop": [[]]}
    for _ in range(150):
        deep = {"a": deep}
    r = client.post("/v1/chat/completions", json=deep)
    assert r.status_code == 400


def test_header_bombs_are_refused(server, client):
    many = {f"x-h{i}": "v" for i in range(150)}
    assert client.get("/get_model_info", headers=many).status_code == 431
    r = client.get("/get_model_info", headers={"x-big": "v" * (40 << 10)})
    assert r.status_code in (400, 431)  # h11 refuses headers past 16 KiB before the app sees them
    # a header block that never ends is cut off, not buffered forever: the server answers 4xx or
    # hangs up, within the socket's timeout (it may do so while the megabyte is still going out)
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: " + b"a" * (1 << 20))
        except (BrokenPipeError, ConnectionResetError):
            pass  # it stopped reading and closed the connection
        try:
            reply = sock.recv(64)
        except ConnectionResetError:
            reply = b""
    assert reply == b"" or reply.startswith(b"HTTP/1.1 4"), reply
    assert client.get("/health").status_code == 200


PATHOLOGICAL = [
    r"a{1,100000}",
    r"x{5000}",
    r".{0,1000}",
    r".*a.{12}",
    r"[ab]*a[ab]{16}",
    "(" * 40 + "a" + ")" * 40,
    "a" * 40_000,
]


@pytest.fixture(scope="module")
def dfa_client(tiny_llama_dir):
    """A server on the regex-automaton backend, where these patterns blow up the automaton."""
    with tiny_server(tiny_llama_dir, {"grammar_backend": "outlines"}, api_key="sk-hostile") as srv:
        with httpx.Client(base_url=srv.url, timeout=60, headers=KEY) as c:
            yield c


COMPILE_TIMEOUT = "compiling the constraint took longer"


@pytest.mark.parametrize("regex", PATHOLOGICAL, ids=range(len(PATHOLOGICAL)))
def test_pathological_regex_is_answered(client, regex):
    """llguidance builds its lexer lazily: these are ordinary requests (or too small a budget
    for the shortest match), never a compilation that runs out of time, and the server stays
    healthy."""
    r = gen(client, regex=regex)
    assert r.status_code == 200 or (
        r.status_code == 400 and r.json()["error"]["param"] in ("regex", "max_new_tokens")
    ), r.text
    assert COMPILE_TIMEOUT not in r.text
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("regex", PATHOLOGICAL, ids=range(len(PATHOLOGICAL)))
def test_pathological_regex_is_refused_before_compiling_for_the_automaton(dfa_client, regex):
    """The static limits name the limit; no automaton is built and timed out."""
    r = gen(dfa_client, regex=regex)
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex", r.text
    message = r.json()["error"]["message"]
    assert "the limit" in message and COMPILE_TIMEOUT not in message, message


def test_pathological_schemas_are_answered(client, dfa_client):
    nested: dict = {"type": "string"}
    for _ in range(80):
        nested = {"type": "object", "properties": {"a": nested}, "required": ["a"]}
    wide = {"type": "array", "items": {"type": "string", "maxLength": 1000}, "maxItems": 50}
    for schema in (nested, "[" * 5000 + "]" * 5000):
        text = schema if isinstance(schema, str) else json.dumps(schema)
        r = gen(client, json_schema=text)
        assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text
    r = gen(dfa_client, json_schema=json.dumps(wide))  # 50 x 1000 characters unrolled
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text
    r = gen(client, json_schema=json.dumps(wide))  # a parser needs no unrolling: closed early
    assert r.status_code == 200 and json.loads(r.json()["text"]) == json.loads(r.json()["text"])
    recursive = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}
                },
            }
        },
        "$ref": "#/$defs/node",
    }
    assert gen(client, json_schema=json.dumps(recursive)).status_code in (200, 400)


def test_idle_connections_outlive_the_clients_keep_alive(server):
    """A connection idle for longer than httpx (and the `openai` client) keep one is still open
    on the server, so a client never reuses one the server is closing."""
    import http.client
    import time

    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("GET", "/health")
    first = conn.getresponse()
    first.read()
    assert first.status == 200
    sock = conn.sock
    time.sleep(5.5)  # past httpx's 5 s keepalive_expiry, and uvicorn's default keep-alive
    conn.request("GET", "/health")
    again = conn.getresponse()
    assert again.status == 200 and conn.sock is sock  # the same connection answered
    conn.close()


def test_api_key_compares_digests(server, monkeypatch):
    import secrets

    seen = []
    real = secrets.compare_digest

    def spy(a, b):
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(secrets, "compare_digest", spy)
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for key in ("x", "sk-hostil", "sk-hostile-but-longer" * 50):
            r = anon.get("/get_model_info", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 401
    assert seen and all(a == b == 32 for a, b in seen)  # equal-length digests, never the keys


def test_programs_run_only_registered_with_checked_arguments(tiny_llama_dir):
    from plait import Engine
    from plait.server.app import create_app
    from plait.server.launch import ServerThread

    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=2048, page_size=4) as engine:
        with ServerThread(create_app(engine, program_registry={"echo": echo})) as srv:
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                for name in ("nope", "__import__", "..%2Fecho", "echo.__globals__"):
                    assert c.post(f"/programs/{name}", json={}).status_code == 404, name
                r = c.post("/programs/echo", json={"arguments": {"word": 5}})
                assert r.status_code == 400 and r.json()["error"]["param"] == "arguments.word"
                r = c.post("/programs/echo", json={"arguments": {"word": "a", "times": "x"}})
                assert r.json()["error"]["param"] == "arguments.times"
                r = c.post("/programs/echo", json={"arguments": {"word": "a", "code": "1"}})
                assert r.json()["error"]["param"] == "arguments.code"
                ok = c.post("/programs/echo", json={"arguments": {"word": "ab", "times": 2}})
                assert ok.status_code == 200 and ok.json()["text"] == "abab"


def test_healthy_afterwards(server, client):
    assert client.get("/health_generate").status_code == 200
    stats = wait_until_idle(server.engine)
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    server.engine.core.scheduler.check()


def test_fuzz_findings_stay_fixed(client):
    # a huge n once built an id per sample before validation (18 GB in seconds)
    for n in (10**12, 2.5, 3012297071891534839808):
        r = client.post("/generate", json={"text": "x", "sampling_params": [{"n": n}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", n
    r = client.post("/generate", json={"text": ["x"] * 1025})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"
    # a tiny temperature or repetition penalty once made the sampler draw from NaNs (500)
    for sp in ({"temperature": 1e-300}, {"repetition_penalty": 1e-300, "temperature": 1.0}):
        assert gen(client, **sp).status_code == 200, sp


HOSTILE_GRAMMARS = [
    'start: start "a" | "a"',  # left recursion (an Earley parser takes it)
    "start: " + " | ".join(f'"w{i}"' for i in range(5_000)),  # a huge alternation
    "start: " + "(" * 300 + '"a"' + ")" * 300,  # deep nesting
    'start: "' + "a" * 60_000 + '"',  # a long literal
    "root ::= root",  # a rule that never ends
    'root ::= "a" undefined_rule',
]


@pytest.mark.parametrize("grammar", HOSTILE_GRAMMARS, ids=range(len(HOSTILE_GRAMMARS)))
def test_hostile_grammars_are_answered_and_leave_nothing_behind(server, client, grammar):
    r = gen(client, ebnf=grammar)
    assert r.status_code == 200 or (
        r.status_code == 400 and r.json()["error"]["param"] in ("ebnf", "grammar", "max_new_tokens")
    ), r.text[:300]
    assert client.get("/health").status_code == 200
    assert gen(client).status_code == 200  # others still served
    wait_until_idle(server.engine)
