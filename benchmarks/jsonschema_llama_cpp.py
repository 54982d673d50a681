"""llama.cpp's server on the `plait bench jsonschema` sample (`--llama-cpp`), for comparison.

llama-cpp-python's server (`make bench-deps`) on the same GGUF file and threads, one request at a
time (it serves one), each schema sent as OpenAI `response_format: {"type": "json_object",
"schema": ...}` with the same user message as plait's runs, greedy. Its server turns the schema
into a GBNF grammar and, where the conversion fails, silently falls back to a grammar for any JSON
value; so its declared coverage is counted here apart, by running the same conversion
(`llama_cpp.llama_grammar.json_schema_to_gbnf`) in this process. Outputs are sorted as plait's
are: valid, finished but invalid (`finish_reason` stop), truncated (length); a request that fails
or times out counts as `failed`, one that kills the server as `crashed` (a new server is started
for the rest).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from plait.benchmarks.llama_cpp import _free_port, _stop, _wait

MODEL_ALIAS = "default"


def declared(schema: Any) -> str | None:
    """None where llama.cpp's converter takes the schema, else its error."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises bare Exceptions and ValueErrors alike
        return f"{type(e).__name__}: {e}"[:200]
    return None


def _classify(schema: Any, text: str, finish_reason: str | None) -> str:
    import jsonschema

    try:
        value = json.loads(text)
        cls = jsonschema.validators.validator_for(schema)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
        return "valid"
    except (ValueError, jsonschema.ValidationError):
        return "finished_invalid" if finish_reason == "stop" else "truncated"
    except Exception:  # the validator itself cannot read the schema (remote $ref, ...)
        return "unvalidated"


def _complete(
    url: str, content: str, schema: Any, max_tokens: int, timeout: float
) -> dict[str, Any]:
    body = {
        "model": MODEL_ALIAS,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": {"type": "json_object", "schema": schema},
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _start(model_path: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "plait.benchmarks.llama_cpp_server",
        "--model",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        "4096",
        "--model_alias",
        MODEL_ALIAS,
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url + "/v1/models", process, 300)
    except BaseException:
        _stop(process)
        raise
    return process, url


def run_llama_cpp_sample(
    model_path: str,
    threads: int,
    items: list[tuple[str, Any, str]],
    budgets: list[int],
    timeout: float,
) -> dict[str, Any]:
    """`items`: (name, schema, user message) per schema. Returns the report's `llama.cpp` entry."""
    refused = {name: why for name, schema, _ in items if (why := declared(schema)) is not None}
    entry: dict[str, Any] = {
        "coverage": 1 - len(refused) / len(items),
        "refused": refused,
        "by_budget": {},
        "outcomes": {},
    }
    process, url = _start(model_path, threads)
    try:
        for budget in budgets:
            kinds, outcomes, tokens, start = [], [], 0, time.perf_counter()
            for name, schema, content in items:
                try:
                    out = _complete(url, content, schema, budget, timeout)
                    choice = out["choices"][0]
                    text = choice["message"]["content"] or ""
                    kind = _classify(schema, text, choice.get("finish_reason"))
                    tokens += out.get("usage", {}).get("completion_tokens", 0)
                except (OSError, urllib.error.HTTPError, KeyError, ValueError) as e:
                    kind, text = "failed", f"{type(e).__name__}: {e}"
                    try:  # a server that segfaulted may not have been reaped yet
                        process.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                    if (
                        process.poll() is not None
                    ):  # the schema crashed the server: counted, and a new one started
                        kind, text = (
                            "crashed",
                            f"llama.cpp's server exited with {process.returncode}",
                        )
                        print(
                            f"llama.cpp: {name} at max_tokens={budget}: {text}; restarting it",
                            flush=True,
                        )
                        process, url = _start(model_path, threads)
                kinds.append(kind)
                outcomes.append(
                    {
                        "schema": name,
                        "kind": kind,
                        "declared": name not in refused,
                        "text": text[-200:],
                    }
                )
            seconds = time.perf_counter() - start
            counts = {
                k: kinds.count(k)
                for k in (
                    "valid",
                    "finished_invalid",
                    "truncated",
                    "failed",
                    "crashed",
                    "unvalidated",
                )
            }
            counts["valid_declared"] = sum(o["kind"] == "valid" and o["declared"] for o in outcomes)
            counts["finished_invalid_declared"] = sum(
                o["kind"] == "finished_invalid" and o["declared"] for o in outcomes
            )
            counts["valid_share_of_all"] = counts["valid"] / len(items)
            counts["tok_per_s"] = tokens / seconds
            entry["by_budget"][budget] = counts
            entry["outcomes"][budget] = outcomes
            print(f"llama.cpp max_tokens={budget}: {counts}", flush=True)
    finally:
        _stop(process)
    return entry
