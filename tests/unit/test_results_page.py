"""docs/results.md is written from the benchmarks' JSON reports, and stays so."""

from __future__ import annotations

import json

import pytest

from plait.benchmarks import results_page

MACHINE = {
    "cpu": "Example CPU",
    "cpus": 2,
    "memory_gib": 23.5,
    "native_isa": "avx2",
    "torch": "2.13.0+cpu",
    "torch_threads": 2,
    "bf16_prefill_gemm": False,
}


def test_the_committed_page_is_what_the_committed_reports_render() -> None:
    assert results_page.main(["--check"]) == 0


def write(folder, name: str, report: dict) -> None:
    (folder / name).write_text(json.dumps({"machine": MACHINE, **report}))


def test_a_section_names_its_command_machine_and_figures(tmp_path) -> None:
    plait_run = {
        "plait": {
            "prefill_tok_s": 3000.0,
            "decode_tok_s": 400.0,
            "sampled_decode_tok_s": 390.0,
            "perplexity": 44.2,
            "decode_share_of_roofline": 0.9,
        },
        "transformers": None,
        "roofline_steps_s": 444.0,
        "prefill_share_of_matmul": 2.1,
    }
    write(
        tmp_path,
        "latency.json",
        {
            "benchmark": "latency",
            "command": "plait bench latency --formats int4",
            "date": "2026-01-02 03:04 UTC",
            "prompt_len": 512,
            "decode_len": 128,
            "results": {
                "int4": plait_run,
                "llama_cpp": {"prefill_tok_s": 300.0, "decode_tok_s": 100.0},
            },
        },
    )
    page = results_page.render(tmp_path, tmp_path)
    assert "`plait bench latency --formats int4`, 2026-01-02 03:04 UTC." in page
    assert "Example CPU, 2 cores, 24 GiB, native kernels `avx2`" in page
    assert "| plait int4 | 3,000.0 | 210% | 400.0 | 90% | 390.0 | 44.2 |" in page
    assert "prefill **10.00×**, decode **4.00×**" in page
    assert "## Continuous batching" not in page  # no report, no section


def test_check_fails_when_a_report_changed(tmp_path) -> None:
    write(
        tmp_path,
        "speculative.json",
        {
            "benchmark": "speculative",
            "rounds": 2,
            "results": [
                {
                    "algorithm": "none",
                    "workload": "chat",
                    "batch": 1,
                    "decode_tok_s": 100.0,
                    "speedup": 1.0,
                    "mean_accept_length": None,
                    "acceptance_rate": None,
                }
            ],
        },
    )
    out = tmp_path / "results.md"
    (tmp_path / "speculative.png").write_bytes(b"")
    common = ["--results", str(tmp_path), "--images", str(tmp_path), "--out", str(out)]
    assert results_page.main(common) == 0
    assert "| chat | 1 | none | 100.0 | **1.00×** |" in out.read_text()
    assert f"![speculative]({tmp_path}/speculative.png)" in out.read_text()
    assert results_page.main([*common, "--check"]) == 0
    write(tmp_path, "speculative.json", {"benchmark": "speculative", "rounds": 3, "results": []})
    assert results_page.main([*common, "--check"]) == 1


def test_the_pd_section_shows_each_setup_and_what_moving_the_kv_costs(tmp_path) -> None:
    def run(replicas: int, transfer: dict | None) -> dict:
        return {
            "replicas": replicas,
            "output_tok_s": 100.0,
            "short_ttft_ms": {"p50": 300.0},
            "itl_ms": {"p50": 11.0, "p99": 3000.0},
            "itl_during_long_prefill_ms": {"p99": 3300.0},
            "long_ttft_ms": {"p50": 3400.0},
            "failed": [],
            "transfer": transfer,
        }

    config = {
        "streams": 4,
        "short_len": 48,
        "output_len": 64,
        "num_long": 4,
        "long_len": 1700,
        "long_output": 8,
        "long_interval": 8.0,
        "quantization": "int4",
    }
    moved = {"tokens": 1696.0, "bytes": 39_082_700.0, "push_ms": 118.0, "prefill_ms": 5907.0}
    write(
        tmp_path,
        "pd.json",
        {
            "benchmark": "pd",
            "config": config,
            "runs": {"colocated": run(1, None), "pd": run(2, moved)},
        },
    )
    page = results_page.render(tmp_path, tmp_path)
    assert "## Prefill–decode disaggregation" in page
    assert (
        "| colocated | 1 | 2 | 100.0 | 300.0 | 11.0 | 3,000.0 | 3,300.0 | 3,400.0 |  |  |  | 0 |"
        in page
    )
    assert (
        "| pd | 2 | 1 each | 100.0 | 300.0 | 11.0 | 3,000.0 | 3,300.0 | 3,400.0 | 39.1 | 118.0 | 5,907.0 | 0 |"  # noqa: E501
        in page
    )


def test_a_latency_run_over_several_models_gets_a_table_each(tmp_path) -> None:
    def run(decode: float) -> dict:
        return {
            "plait": {
                "prefill_tok_s": 600.0,
                "decode_tok_s": decode,
                "sampled_decode_tok_s": decode,
                "perplexity": 30.0,
                "decode_share_of_roofline": 0.5,
            },
            "transformers": None,
            "roofline_steps_s": 2 * decode,
            "prefill_share_of_matmul": 1.0,
        }

    def model(decode: float, kv_share: float) -> dict:
        return {
            "native": run(decode),
            "kv": {
                "context": 8192,
                "held_bytes_per_token": 4090.0,
                "full_attention_bytes_per_token": 4090.0 / kv_share,
                "share_of_full_attention": kv_share,
            },
            "llama_cpp": {
                "prefill_tok_s": 300.0,
                "decode_tok_s": decode / 2,
                "version": "0.3.36",
                "agreement_with_plait": {
                    "positions": 212,
                    "top1_agreement": 0.958,
                    "median_abs_logprob_delta": 0.047,
                },
            },
        }

    models = {"smollm2": model(240.0, 1.0), "gemma3-270m": model(70.0, 0.22)}
    write(
        tmp_path,
        "latency.json",
        {
            "benchmark": "latency",
            "command": "plait bench latency --models smollm2,gemma3-270m",
            "date": "2026-01-02 03:04 UTC",
            "prompt_len": 512,
            "decode_len": 128,
            "results": models["smollm2"],
            "models": models,
        },
    )
    page = results_page.render(tmp_path, tmp_path)
    gemma = page[page.index("**gemma3-270m**") :]
    assert page.index("**smollm2**") < page.index("**gemma3-270m**")
    assert "| plait native | 600.0 | 100% | 70.0 | 50% | 70.0 | 30.0 |" in gemma
    assert "| llama.cpp 0.3.36 (same GGUF) | 300.0 |  | 35.0 |" in gemma
    assert "4,090 bytes, 22% of what full attention would hold" in gemma
    assert "plait native against llama.cpp: prefill **2.00×**, decode **2.00×**" in gemma
    assert "median |Δ| 0.047, top-1 agreement 96%" in gemma


def test_a_report_beside_its_benchmarks_main_one_draws_figures_of_its_own(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    images = tmp_path / "images"
    main = results_page.draw_figures(results_page.RESULTS / "kernels.json", images)
    beside = results_page.draw_figures(results_page.RESULTS / "kernels-avx2.json", images)
    assert [p.name for p in main] == ["kernels-gflops.png"]
    assert [p.name for p in beside] == ["kernels-avx2-gflops.png"]
    assert main[0].read_bytes() != beside[0].read_bytes()
