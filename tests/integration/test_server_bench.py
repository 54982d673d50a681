"""`plait bench serving` against a tiny server: both protocols, both datasets, bounded runs."""

from __future__ import annotations

import json

import pytest

from plait.benchmarks.serving import main, make_dataset
from tests.integration.server_support import tiny_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir, served_model_name="tiny") as srv:
        yield srv


@pytest.mark.parametrize("backend", ["native", "openai"])
def test_bench_serving_shared_prefix(server, backend, tmp_path, capsys):
    out = tmp_path / "serving.json"
    # no --model-name: OpenAI requests name the model the server lists
    argv = [
        "--url",
        server.url,
        "--backend",
        backend,
        "--dataset",
        "shared-prefix",
        "--num-prompts",
        "8",
        "--prefix-len",
        "60",
        "--num-groups",
        "2",
        "--input-len",
        "5",
        "--output-len",
        "4",
        "--concurrency",
        "1,4",
        "--max-duration",
        "30",
        "--label",
        backend,
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "cache hit" in printed
    (entry,) = json.loads(out.read_text())
    assert [r["concurrency"] for r in entry["runs"]] == [1, 4]
    for run in entry["runs"]:
        assert run["completed"] == 8 and run["failed"] == 0
        assert run["output_tokens"] == 8 * 4
        assert run["ttft_ms"]["median"] > 0 and run["itl_ms"]["p99"] >= run["itl_ms"]["median"]
        assert run["cache_hit_rate"] > 0.5  # 8 prompts over 2 long shared prefixes


def test_bench_is_bounded_in_time(server, tmp_path):
    argv = [
        "--url",
        server.url,
        "--num-prompts",
        "500",
        "--output-len",
        "4",
        "--concurrency",
        "2",
        "--max-duration",
        "0.5",
        "--output",
        str(tmp_path / "s.json"),
    ]
    assert main(argv) == 0
    (entry,) = json.loads((tmp_path / "s.json").read_text())
    assert 0 < entry["runs"][0]["completed"] < 500  # stopped by --max-duration, not the prompts


def test_random_dataset_lengths():
    import argparse

    args = argparse.Namespace(
        seed=1,
        range_ratio=0.5,
        dataset="random",
        num_prompts=50,
        input_len=40,
        output_len=20,
        prefix_len=0,
        num_groups=1,
    )
    prompts = make_dataset(args)
    assert all(20 <= len(p.text.split()) <= 40 and 10 <= p.output_len <= 20 for p in prompts)
    assert len({p.output_len for p in prompts}) > 3


@pytest.mark.parametrize("backend", ["native", "openai"])
def test_sampled_runs_send_their_sampling(server, backend, monkeypatch):
    """`plait bench llama-cpp --temperature/--top-p` sends those to both servers (greedy
    otherwise)."""
    import asyncio

    from plait.benchmarks import serving
    from plait.benchmarks.serving import Prompt, run_load

    sent: list[dict] = []
    real = serving._payload

    def spy(*args):
        path, body = real(*args)
        sent.append(body.get("sampling_params", body))
        return path, body

    monkeypatch.setattr(serving, "_payload", spy)
    prompts = [Prompt("a story about", 6)] * 4
    sampling = {"temperature": 0.8, "top_p": 0.9}
    results, _ = asyncio.run(
        run_load(server.url, backend, prompts, 2, None, 30, "tiny", sampling=sampling)
    )
    assert all(r.ok and r.output_tokens == 6 for r in results), results
    assert all(s["temperature"] == 0.8 and s["top_p"] == 0.9 for s in sent) and len(sent) == 4
    asyncio.run(run_load(server.url, backend, prompts[:1], 1, None, 30, "tiny"))
    assert sent[-1]["temperature"] == 0 and "top_p" not in sent[-1]
