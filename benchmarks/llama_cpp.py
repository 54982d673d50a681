"""`plait bench llama-cpp`: plait's server beside llama.cpp's, same GGUF file, same threads.

Starts `plait serve` (with the engine flags given, e.g. `--quantization int4`), loads it with the
serving benchmark's random dataset at each concurrency over `/v1/completions`, stops it, then does
the same with `python -m llama_cpp.server` (llama-cpp-python, installed by `make bench-deps`, not
by plait). The servers run one after the other, never side by side: both would want every core.
Prints each server's output tokens/s, TTFT and ITL, and plait's ratio to llama.cpp.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

from plait.benchmarks.common import print_table, write_json
from plait.benchmarks.serving import make_dataset, run_load, summarize


def cpu_has_amx() -> bool:
    """Whether this CPU advertises AMX int8 tiles (Linux's /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_int8" in line for line in f)
    except OSError:
        return False


def keep_llama_cpp_off_amx() -> bool:
    """On a CPU with AMX, load llama.cpp's weights into its plain CPU buffers, not its AMX ones.

    llama.cpp repacks Q4_0/Q4_1/Q8_0/K-quant weights for AMX when the CPU has it, and its AMX matmul
    crashes on some such machines (ggml-org/llama.cpp#20824; a Xeon VM here: SIGSEGV in
    `ggml_backend_amx_mul_mat` on the first Q4_1 decode, which took the whole benchmark process with
    it). Turning off llama.cpp's extra buffer types (`use_extra_bufts`) for every model this process
    loads avoids the path; its AVX-512 kernels run instead. Returns whether it did.
    """
    if not cpu_has_amx():
        return False
    import llama_cpp.llama_cpp as api

    if getattr(api.llama_model_default_params, "plait_no_extra_bufts", False):
        return True
    defaults = api.llama_model_default_params

    def without_extra_buffers():  # noqa: ANN202 (llama.cpp's ctypes struct)
        params = defaults()
        params.use_extra_bufts = False
        return params

    without_extra_buffers.plait_no_extra_bufts = True  # type: ignore[attr-defined]
    without_extra_buffers.__wrapped__ = defaults  # type: ignore[attr-defined]
    api.llama_model_default_params = without_extra_buffers
    return True


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given on this command line (those that differ from the defaults)."""
    import dataclasses

    from plait.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    flags = []
    for klass in (ModelConfig, CacheConfig, SchedulerConfig, EngineConfig):
        for f in dataclasses.fields(klass):
            value = getattr(args, f.name, f.default)
            if f.name in ("model", "cache", "scheduler") or value == f.default:
                continue
            flag = "--model" if f.name == "model_path" else "--" + f.name.replace("_", "-")
            flags += [flag] if value is True else [flag, str(value)]
    return flags


def _sampling(args: argparse.Namespace) -> dict[str, float]:
    """The requests' sampling: greedy by default; `--temperature` / `--top-p` for sampled runs."""
    return {"temperature": getattr(args, "temperature", 0.0), "top_p": getattr(args, "top_p", 1.0)}


def _run_server(
    label: str, cmd: list[str], ready_path: str, port: int, args: argparse.Namespace
) -> list[dict]:
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    runs = []
    try:
        _wait(url + ready_path, process, 300)
        warm = make_dataset(args, seed=999)[:2]
        sampling = _sampling(args)
        asyncio.run(run_load(url, "openai", warm, 1, None, 60, args.model_name, sampling=sampling))
        for level in [int(c) for c in args.concurrency.split(",")]:
            prompts = make_dataset(args, seed=level)
            results, duration = asyncio.run(
                run_load(
                    url,
                    "openai",
                    prompts,
                    level,
                    None,
                    args.max_duration,
                    args.model_name,
                    sampling=sampling,
                )
            )
            summary = summarize(results, duration)
            runs.append({"server": label, "concurrency": level, **summary})
            print(
                f"{label} c={level}: {summary['output_tok_s']:.1f} output tok/s, "
                f"{summary['failed']} failed",
                flush=True,
            )
    finally:
        _stop(process)
    return runs


def run_llama_cpp_bench(args: argparse.Namespace) -> int:
    try:
        import llama_cpp  # noqa: F401
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"bench llama-cpp: needs llama-cpp-python[server] (`make bench-deps`): {e}"
        ) from e
    import torch

    from plait.runtime.model_loader.locate import locate_checkpoint

    loc = locate_checkpoint(args.model_path)
    if loc.kind != "gguf":
        raise SystemExit("bench llama-cpp: llama.cpp needs a GGUF file (--model path/to/file.gguf)")
    threads = torch.get_num_threads()
    results: list[dict[str, Any]] = []
    port = _free_port()
    plait_cmd = [
        sys.executable,
        "-m",
        "plait.server.cli",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        args.model_name,
        "--log-level",
        "warning",
        *_engine_flags(args),
    ]
    results += _run_server("plait", plait_cmd, "/health", port, args)
    port = _free_port()
    context = args.input_len * 2 + args.output_len + 64  # words are ~1.3 tokens
    llama_cmd = [
        sys.executable,
        "-m",
        "plait.benchmarks.llama_cpp_server",
        "--model",
        loc.path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        str(context),
        "--model_alias",
        args.model_name,
    ]
    results += _run_server("llama.cpp", llama_cmd, "/v1/models", port, args)

    rows = []
    by = {(r["server"], r["concurrency"]): r for r in results}
    for r in results:
        ref = by.get(("llama.cpp", r["concurrency"]))
        ratio = r["output_tok_s"] / ref["output_tok_s"] if ref and ref["output_tok_s"] else None
        rows.append(
            [
                r["server"],
                r["concurrency"],
                r["completed"],
                r["failed"],
                r["output_tok_s"],
                r["ttft_ms"]["median"],
                r["itl_ms"]["median"],
                ratio,
            ]
        )
    print(
        f"\n{args.num_prompts} requests per run, ~{args.input_len} words in, "
        f"<= {args.output_len} tokens out, {threads} threads, {os.path.basename(loc.path)}, "
        f"sampling {_sampling(args)}"
    )
    print_table(
        [
            "server",
            "conc",
            "ok",
            "fail",
            "output tok/s",
            "TTFT med ms",
            "ITL med ms",
            "x llama.cpp",
        ],
        rows,
    )
    write_json(
        args.output,
        {
            "benchmark": "llama_cpp",
            "threads": threads,
            "model": loc.path,
            "engine_flags": _engine_flags(args),
            "sampling": _sampling(args),
            "results": results,
        },
    )
    return 0


def add_llama_cpp_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency", default="1,16", help="comma-separated; one run each, per server"
    )
    parser.add_argument(
        "--num-prompts", dest="num_prompts", type=int, default=32, help="requests per run"
    )
    parser.add_argument("--input-len", dest="input_len", type=int, default=128, help="words")
    parser.add_argument("--output-len", dest="output_len", type=int, default=128, help="tokens")
    parser.add_argument(
        "--max-duration",
        dest="max_duration",
        type=float,
        default=600.0,
        help="seconds per run after which no request is launched",
    )
    parser.add_argument(
        "--output", default="bench-results/llama_cpp.json", help="JSON file of the results"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (both servers)")
    parser.add_argument(
        "--top-p",
        dest="top_p",
        type=float,
        default=1.0,
        help="nucleus sampling (with --temperature)",
    )
    parser.set_defaults(
        dataset="random", range_ratio=0.5, prefix_len=0, num_groups=1, seed=0, model_name="default"
    )
