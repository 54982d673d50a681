"""The `plait` command line, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "plait", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    assert "generate" in out.stdout and "bench" in out.stdout


def test_engine_switches_that_default_on_can_be_turned_off():
    import argparse

    from plait.runtime.config_flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).budget_closing is True
    assert parser.parse_args(["--no-budget-closing"]).budget_closing is False
    assert parser.parse_args(["--disable-jump-forward"]).disable_jump_forward is True


def test_generate_streams_to_stdout(tiny_llama_dir, tiny_engine):
    out = run(
        "generate",
        "Hello",
        "--model",
        str(tiny_llama_dir),
        "--max-tokens",
        "6",
        "--max-total-tokens",
        "256",
    )
    assert out.returncode == 0, out.stderr
    expected = tiny_engine.generate("Hello", {"max_new_tokens": 6, "temperature": 0})["text"]
    assert out.stdout == expected + "\n"


def test_generate_with_chat_template(tiny_llama_dir):
    out = run(
        "generate",
        "Hi",
        "--chat",
        "--model",
        str(tiny_llama_dir),
        "--max-tokens",
        "3",
        "--max-total-tokens",
        "256",
    )
    assert out.returncode == 0, out.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    out = run("generate", "Hi", "--model", str(tmp_path / "missing"))
    assert out.returncode != 0
    assert "does not exist" in out.stderr and "smollm2, gemma3-270m" in out.stderr


def test_bench_throughput_smoke(tiny_llama_dir, tmp_path):
    out_file = tmp_path / "t.json"
    out = run(
        "bench",
        "throughput",
        "--model",
        str(tiny_llama_dir),
        "--num-requests",
        "4",
        "--output-len",
        "4",
        "--concurrency",
        "1,2",
        "--prefix-len",
        "40",
        "--no-transformers",
        "--max-total-tokens",
        "4096",
        "--output",
        str(out_file),
    )
    assert out.returncode == 0, out.stderr
    assert "plait c=2" in out.stdout and "radix cache" in out.stdout
    import json

    data = json.loads(out_file.read_text())
    assert len(data["results"]["random"]) == 2
    assert data["results"]["shared_prefix"][0]["cache_hit_rate"] > 0.5
    assert "of roofline" in out.stdout and data["roofline_steps_s"] > 0
    assert all(r["steps_s"] > 0 for r in data["results"]["random"])


def test_bench_throughput_sampled(tiny_llama_dir, tmp_path):
    out_file = tmp_path / "t.json"
    out = run(
        "bench",
        "throughput",
        "--model",
        str(tiny_llama_dir),
        "--num-requests",
        "3",
        "--output-len",
        "5",
        "--concurrency",
        "2",
        "--prefix-len",
        "20",
        "--no-transformers",
        "--max-total-tokens",
        "4096",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--output",
        str(out_file),
    )
    assert out.returncode == 0, out.stderr
    assert "temperature 0.7, top-p 0.9, seeded" in out.stdout
    import json

    data = json.loads(out_file.read_text())
    assert data["args"]["temperature"] == 0.7 and data["args"]["top_p"] == 0.9
    assert data["results"]["random"][0]["output_tok_s"] > 0


def test_bench_speculative_alternates_engines(tiny_llama_dir, tmp_path):
    out_file = tmp_path / "s.json"
    out = run(
        "bench",
        "speculative",
        "--model",
        str(tiny_llama_dir),
        "--algorithms",
        "ngram",
        "--batch-sizes",
        "1,2",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "12",
        "--rounds",
        "2",
        "--max-total-tokens",
        "8192",
        "--output",
        str(out_file),
    )
    assert out.returncode == 0, out.stderr
    assert "2 alternating rounds" in out.stdout
    import json

    data = json.loads(out_file.read_text())
    assert data["rounds"] == 2
    rows = {(r["algorithm"], r["workload"], r["batch"]): r for r in data["results"]}
    assert set(rows) == {
        (a, w, b) for a in ("none", "ngram") for w in ("extractive", "chat") for b in (1, 2)
    }
    assert all(r["decode_tok_s"] > 0 for r in rows.values())
    assert rows[("none", "chat", 1)]["speedup"] == 1.0


def test_bench_llama_cpp_names_its_setup_when_missing(tmp_path):
    """Without llama-cpp-python the comparison stops with the command that installs it."""
    (tmp_path / "llama_cpp.py").write_text("raise ImportError('not installed here')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "plait", "bench", "llama-cpp"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode != 0 and "make bench-deps" in out.stderr


def test_bench_latency_takes_the_engine_flags_and_the_deterministic_format(
    tiny_llama_dir, tmp_path
):
    import json

    out_path = tmp_path / "latency.json"

    def invariance(formats: str, *flags: str) -> dict[str, str]:
        out = run(
            "bench",
            "latency",
            "--model",
            str(tiny_llama_dir),
            "--formats",
            formats,
            *("--prompt-len", "24", "--decode-len", "4", "--repeats", "1", "--kv-context", "0"),
            *("--no-transformers", "--no-llama-cpp", "--output", str(out_path), *flags),
        )
        assert out.returncode == 0, out.stderr
        results = json.loads(out_path.read_text())["results"]
        return {f: results[f]["plait"]["execution"]["batch_invariant"] for f in formats.split(",")}

    assert invariance("float32,deterministic") == {"float32": "off", "deterministic": "on"}
    # an engine flag reaches the engines the bench builds
    assert invariance("float32", "--deterministic") == {"float32": "on"}


def test_bench_latency_reports_roofline_and_perplexity_per_format(tiny_llama_dir, tmp_path):
    import json

    out_path = tmp_path / "latency.json"
    twin = tmp_path / "twin"  # the same checkpoint under another name: a second model, side by side
    twin.symlink_to(tiny_llama_dir)
    out = run(
        "bench",
        "latency",
        "--models",
        f"{tiny_llama_dir},{twin}",
        "--kv-context",
        "40",
        "--formats",
        "float32,int4",
        "--prompt-len",
        "32",
        "--decode-len",
        "6",
        "--repeats",
        "1",
        "--no-transformers",
        "--no-llama-cpp",
        "--output",
        str(out_path),
    )
    assert out.returncode == 0, out.stderr
    assert (
        "of matmul" in out.stdout and "read bandwidth" in out.stdout and "of greedy" in out.stdout
    )
    report = json.loads(out_path.read_text())
    assert set(report["models"]) == {str(tiny_llama_dir), str(twin)}
    assert "KV bytes/token of context" in out.stdout and "of full attention at 40" in out.stdout
    side_by_side = [
        line for line in out.stdout.splitlines() if str(twin) in line and "metric" in line
    ]
    assert side_by_side and str(tiny_llama_dir) in side_by_side[0]  # a column per model
    for model in report["models"].values():  # no sliding layers: it holds what full attention does
        assert model["kv"]["held_bytes_per_token"] == model["kv"]["full_attention_bytes_per_token"]
    assert report["bandwidth_bytes_s"] > 1e8
    f32, int4 = report["results"]["float32"], report["results"]["int4"]
    assert int4["plait"]["weight_bytes"] < f32["plait"]["weight_bytes"] / 4
    assert int4["roofline_steps_s"] > f32["roofline_steps_s"]
    assert "weights themselves read at" in out.stdout
    for r in (f32, int4):
        assert r["plait"]["decode_tok_s"] > 0 and r["plait"]["perplexity"] > 1
        assert r["plait"]["sampled_decode_tok_s"] > 0
        # the roofline is a plain read of those very weights
        assert r["roofline_steps_s"] == pytest.approx(1 / r["plait"]["weights_read_s"])
        assert (
            0 < r["plait"]["decode_share_of_roofline"]
        )  # each decode run against the reads beside it


def test_bench_overhead_compares_a_skinny_twin(tiny_llama_dir, tmp_path):
    import json

    out_path = tmp_path / "overhead.json"
    out = run(
        "bench",
        "overhead",
        "--model",
        str(tiny_llama_dir),
        "--formats",
        "int4",
        "--decode-len",
        "8",
        "--repeats",
        "1",
        "--output",
        str(out_path),
    )
    assert out.returncode == 0, out.stderr
    assert "overhead share" in out.stdout and "python share" in out.stdout
    result = json.loads(out_path.read_text())["results"]["int4"]
    assert result["step_ms"] > 0 and result["twin_step_ms"] > 0 and result["overhead_share"] > 0
    assert 0 < result["python_step_ms"] and result["python_share"] == pytest.approx(
        result["python_step_ms"] / result["step_ms"]
    )


def test_kernels_stubbed_swaps_the_native_kernels_and_restores_them():
    import torch

    from plait.benchmarks.overhead import kernels_stubbed
    from plait.kernels import quant_matmul as qm
    from plait.kernels.quant_weights import quantize_int4

    if not qm.native_quant_available():
        pytest.skip("native CPU kernels did not build")
    qw, x = quantize_int4(torch.randn(8, 64)), torch.randn(1, 64)
    expected, real = qm.quant_matmul(x, qw), qm._kernels()[0]
    with kernels_stubbed():
        assert qm._kernels()[0] is not real and qm._kernels()[0]() == -1
    assert qm._kernels()[0] is real
    torch.testing.assert_close(qm.quant_matmul(x, qw), expected)


def test_kernels_stubbed_covers_bursts_of_decode_steps(tiny_llama_dir):
    from plait import Engine
    from plait.benchmarks.overhead import kernels_stubbed
    from plait.kernels import decode_stack

    if not decode_stack.burst_available():
        pytest.skip("native CPU kernels did not build")
    real = decode_stack.run_burst
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=512) as engine:
        engine.generate(
            input_ids=[5, 6, 7], sampling_params=params
        )  # the engine learns a step's time
        bursts = engine.stats()["total_burst_steps"]
        with kernels_stubbed():
            out = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
        assert engine.stats()["total_burst_steps"] > bursts
    assert out["output_ids"][-8:] == [100] * 8  # a burst's tokens came from the stub
    assert decode_stack.run_burst is real


def _subparsers(parser, path=("plait",)):
    """(command path, parser) of every command and bench workload."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, (*path, name))


def test_every_flag_has_help_that_says_its_default():
    from plait.cli import build_parser

    missing = []
    for path, parser in _subparsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                shown = formatter._get_help_string(action)
                if "default" not in shown or shown.startswith(" "):
                    missing.append((" ".join(path), action.option_strings[0], shown))
    assert not missing, missing


def test_help_shows_defaults_choices_and_aliases():
    out = run("serve", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "--port PORT the port to listen on (0-65535) (default: 30000)" in text
    assert (
        "--page-size PAGE_SIZE, --block-size PAGE_SIZE KV cache tokens per page (1-1024) "
        "(default: 1)" in text
    )
    assert "--closed-finish-reason {length,stop}" in text and "(default: length)" in text
    assert "--max-queued-requests N, --max-queue N" in text
    assert "--dtype {auto,float32,bfloat16,float16}" in text


BAD_VALUES = [
    (["serve", "--page-size", "0"], "--page-size/--block-size", "must be an integer in [1, 1024]"),
    (["serve", "--block-size", "0"], "--page-size/--block-size", "got 0"),
    (["serve", "--port", "70000"], "--port", "must be in [0, 65535]"),
    (["serve", "--dp", "0"], "--dp/--dp-size/--data-parallel-size", "at least 1"),
    (["serve", "--router-cache-threshold", "2"], "--router-cache-threshold", "[0, 1]"),
    (["serve", "--dp", "2", "--prefill-replicas", "2"], "--prefill-replicas", "in [1, 1]"),
    (["serve", "--prefill-replica", "http://p"], "--prefill-replica", "needs --replica"),
    (["serve", "--dp", "2", "--role", "decode"], "--role", "--prefill-replicas"),
    (["serve", "--role", "prefill", "--disable-radix-cache"], "--role", "radix cache"),
    (["serve", "--max-queue", "-1"], "--max-queued-requests/--max-queue", "non-negative"),
    (["serve", "--closed-finish-reason", "eos"], "--closed-finish-reason", "invalid choice"),
    (["serve", "--speculation", "always"], "--speculation", "needs a speculative_algorithm"),
    (["serve", "--tensor-parallel-size", "0"], "--tp-size/--tp/--tensor-parallel-size", "positive"),
    (["generate", "hi", "--max-total-tokens", "0"], "--max-total-tokens", "at least page_size"),
    (["generate", "hi", "--dtype", "float64"], "--dtype", "invalid choice"),
    (["generate", "hi", "--mem-fraction-static", "1.5"], "--mem-fraction-static", "(0, 1)"),
    (
        ["bench", "latency", "--max-num-seqs", "0"],
        "--max-running-requests/--max-num-seqs",
        "positive",
    ),
    (["bench", "json", "--mask-batch", "x"], "--mask-batch", "invalid int value"),
]


@pytest.mark.parametrize(
    ("argv", "flag", "reason"), BAD_VALUES, ids=[" ".join(a) for a, _, _ in BAD_VALUES]
)
def test_a_bad_value_is_a_usage_error_naming_the_flag(argv, flag, reason, capsys):
    from plait.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    command = "plait " + " ".join(a for a in argv[:2] if not a.startswith("-") and a != "hi")
    assert usage.startswith(f"usage: {command} [options]")
    assert error.startswith(f"{command}: error: argument {flag}: ") and reason in error, error


def test_a_bad_value_is_refused_before_anything_loads():
    out = run("serve", "--page-size", "0", "--model", "/no/such/model.gguf")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].startswith(
        "plait serve: error: argument --page-size/--block-size:"
    )


SAME = [
    (["--model", "m.gguf"], ["--model-path", "m.gguf"]),
    (["--context-length", "512"], ["--max-model-len", "512"]),
    (["--page-size", "16"], ["--block-size", "16"]),
    (["--max-running-requests", "8"], ["--max-num-seqs", "8"]),
    (["--num-draft-tokens", "3"], ["--speculative-num-draft-tokens", "3"]),
    (["--draft-model-path", "d"], ["--speculative-draft-model-path", "d"]),
    (["--tp", "2"], ["--tp-size", "2"], ["--tensor-parallel-size", "2"]),
    (["--dp", "2"], ["--dp-size", "2"], ["--data-parallel-size", "2"]),
    (["--max-queue", "5"], ["--max-queued-requests", "5"]),
]


@pytest.mark.parametrize("spellings", SAME, ids=[s[-1][0] for s in SAME])
def test_sglang_and_vllm_spellings_set_the_same_config(spellings):
    from plait.cli import build_parser
    from plait.runtime.config_flags import engine_kwargs
    from plait.server.cli import server_config

    parser = build_parser()
    parsed = [parser.parse_args(["serve", *argv]) for argv in spellings]
    configs = [(engine_kwargs(a), server_config(a), a.dp_size) for a in parsed]
    assert all(c == configs[0] for c in configs)
    assert configs[0] != (
        engine_kwargs(d := parser.parse_args(["serve"])),
        server_config(d),
        d.dp_size,
    )


def test_models_lists_the_packages_and_architectures(gguf_path):
    import json

    listing = run("models", "--json")
    assert listing.returncode == 0, listing.stderr
    found = json.loads(listing.stdout)
    by_name = {p["name"]: p for p in found["packages"]}
    assert set(by_name) >= {"smollm2", "gemma3-270m"}
    assert by_name["smollm2"]["status"] == "ready" and by_name["smollm2"]["path"] == gguf_path
    assert {a["family"] for a in found["architectures"]} >= {"llama", "qwen3", "phi3", "gemma3"}
    text = run("models")
    assert (
        text.returncode == 0 and "gemma3-270m" in text.stdout and "Gemma3ForCausalLM" in text.stdout
    )


def test_the_documented_prefill_decode_commands_parse():
    import re
    import shlex
    from pathlib import Path

    from plait.cli import build_parser

    doc = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    section = doc.split("## Prefill–decode disaggregation", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    commands = [shlex.split(line.split("#")[0].rstrip(" &")) for line in block.splitlines()]
    assert len(commands) == 5 and all(c[:2] == ["plait", "serve"] for c in commands)
    parsed = [build_parser().parse_args(c[1:]) for c in commands]
    assert [a.prefill_replicas for a in parsed[:2]] == [1, 1]
    assert parsed[1].router_prefill_min_chars == 2000
    assert [a.role for a in parsed[2:4]] == ["prefill", "decode"]
    assert parsed[4].prefill_urls == ["http://127.0.0.1:30001"]


@pytest.mark.slow
def test_bench_kv_tiers_smoke(tiny_llama_dir, tmp_path):
    """Every part of `plait bench kv-tiers` at a tiny size; `shared` runs where redis-server is
    installed and says it was skipped elsewhere."""
    import json
    import shutil

    out_file = tmp_path / "kv.json"
    out = run(
        "bench",
        "kv-tiers",
        "--model",
        str(tiny_llama_dir),
        "--quantization",
        "int8",
        "--page-size",
        "4",
        "--prefix-len",
        "200",
        "--num-prefixes",
        "4",
        "--shared-len",
        "160",
        "--requests",
        "8",
        "--pool-prefixes",
        "2",
        "--output-len",
        "2",
        "--concurrency",
        "2",
        "--output",
        str(out_file),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out_file.read_text())
    # the tiers hold whole blocks (64 tokens here) that end before the prompt's last token
    assert results["restart"]["warm_cached_tokens"] == 192
    assert [r["setup"] for r in results["working_set"]] == ["pool only", "disk tier"]
    assert results["working_set"][1]["hit_rate"] > results["working_set"][0]["hit_rate"]
    if shutil.which("redis-server"):
        assert results["shared"]["second_replica_cached_tokens"] == 192
        assert "second replica TTFT s" in out.stdout
    else:
        assert "shared: skipped" in out.stdout


@pytest.mark.slow
def test_bench_pd_smoke(tiny_llama_dir, tmp_path):
    """`plait bench pd` serves its load colocated and disaggregated (real replicas and router)
    and reports the KV moved per long prompt."""
    import json

    out_file = tmp_path / "pd.json"
    out = run(
        "bench",
        "pd",
        "--model",
        str(tiny_llama_dir),
        "--quantization",
        "int8",
        "--page-size",
        "4",
        "--streams",
        "2",
        "--short-len",
        "8",
        "--output-len",
        "4",
        "--long-len",
        "120",
        "--long-output",
        "2",
        "--num-long",
        "1",
        "--long-interval",
        "0.5",
        "--max-total-tokens",
        "2048",
        "--setups",
        "colocated,pd",
        "--output",
        str(out_file),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out_file.read_text())["runs"]
    assert set(runs) == {"colocated", "pd"}
    assert all(r["failed"] == [] and r["short_requests"] > 0 for r in runs.values())
    assert runs["pd"]["transfer"]["bytes"] > 0 and runs["pd"]["transfer"]["tokens"] > 0
    assert "transfer" not in runs["colocated"]
    assert "colocated" in out.stdout and "pd" in out.stdout


def test_bench_kernels_times_each_block_type_and_names_a_shape_it_cannot_take(tmp_path):
    out = tmp_path / "kernels.json"
    args = ("bench", "kernels", "--batch-sizes", "1,3", "--min-seconds", "0.01")
    done = run(*args, "--block-types", "Q5_0,Q4_K", "--shape", "64x256", "--output", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    timed = {(r["block_type"], r["m"]) for r in report["results"] if r["gflops"] > 0}
    assert timed == {(kind, m) for kind in ("Q5_0", "Q4_K") for m in (1, 3)}
    # Q5_0's five-bit rows read the file's 22 bytes per 32 weights
    q5 = next(r for r in report["results"] if r["block_type"] == "Q5_0")
    assert q5["weight_bytes"] == 64 * 256 // 32 * 22
    refused = run(*args, "--block-types", "Q4_K", "--shape", "64x640")
    assert refused.returncode != 0
    assert "--shape: K = 640 is not a multiple of 256, as Q4_K needs" in refused.stderr
