"""`--plot DIR`: each benchmark's JSON, in the shape its `run_*_bench` writes, becomes figures."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from plait.benchmarks.plots import PLOTTERS, benchmark_of, plot_file  # noqa: E402


def _lat(ms: float) -> dict:
    return {"mean": ms, "median": ms * 0.9, "p99": ms * 3}


def _serving_run(c: int, samples: bool = True) -> dict:
    run = {
        "concurrency": c,
        "output_tok_s": 40.0 * c,
        "ttft_ms": _lat(20.0 * c),
        "itl_ms": _lat(5.0),
    }
    if samples:
        run["samples"] = {"ttft_ms": [10.0 * c, 20.0 * c, 40.0 * c], "itl_ms": [4.0, 5.0, 9.0]}
    return run


RESULTS = {
    "serving": [
        {"label": "plait", "runs": [_serving_run(1), _serving_run(4)]},
        {"label": "old", "runs": [_serving_run(1, samples=False)]},
    ],
    "throughput": {
        "benchmark": "throughput",
        "roofline_steps_s": 300.0,
        "results": {
            "random": [
                {"concurrency": c, "output_tok_s": 50.0 * c, "steps_s": 100.0} for c in (1, 8)
            ],
            "transformers": [{"batch_size": 8, "output_tok_s": 90.0}],
            "shared_prefix": [{"cache": "on", "seconds": 2.0}, {"cache": "off", "seconds": 6.0}],
        },
    },
    "latency": {
        "benchmark": "latency",
        "results": {
            "int4": {
                "plait": {"decode_tok_s": 390.0},
                "transformers": None,
                "roofline_steps_s": 500.0,
            },
            "float32": {
                "plait": {"decode_tok_s": 49.0},
                "transformers": {"decode_tok_s": 20.0},
                "roofline_steps_s": 60.0,
            },
            "llama_cpp": {"decode_tok_s": 108.0, "prefill_tok_s": 344.0},
        },
    },
    "programs": {
        "benchmark": "programs",
        "results": [
            {"workload": w, "system": s, "programs_per_s": p}
            for w in ("select", "agent")
            for s, p in (("plait", 3.0), ("plait (cache off)", 1.0))
        ],
    },
    "jsonschema": {
        "benchmark": "jsonschema",
        "num_schemas": 10,
        "backends": {
            "llguidance": {
                "coverage": 0.9,
                "by_budget": {"256": {"valid": 5, "closed_valid": 3, "truncated": 1}},
                "decode_b1": {"free": 80.0, "constrained": 60.0},
            },
            "outlines": {
                "coverage": 0.5,
                "by_budget": {"256": {"valid": 3, "closed_valid": 1, "truncated": 1}},
                "decode_b1": "GrammarError: too many states",
            },
        },
    },
    "json": {
        "benchmark": "json",
        "results": {
            n: {"seconds": 2.0, "output_tokens": t}
            for n, t in (
                ("unconstrained", 400),
                ("jump-forward on", 300),
                ("jump-forward off", 200),
            )
        }
        | {"steps": {"unconstrained_step_ms": 4.0, "constrained_step_ms": 4.4}},
    },
    "speculative": {
        "benchmark": "speculative",
        "results": [
            {"algorithm": a, "workload": "chat", "batch": 1, "decode_tok_s": v}
            for a, v in (("none", 40.0), ("ngram", 55.0))
        ],
    },
    "data-parallel": {
        "config": {},
        "runs": {
            "dp1": {"output_tok_s": 100.0, "cache_hit_rate": 0.8},
            "dp2-round-robin": {"output_tok_s": 150.0, "cache_hit_rate": 0.4},
        },
    },
    "llama-cpp": {
        "benchmark": "llama_cpp",
        "results": [
            {"server": s, **_serving_run(c)} for s in ("plait", "llama.cpp") for c in (1, 4)
        ],
    },
    "overhead": {
        "benchmark": "overhead",
        "results": {"int4": {"step_ms": 2.8, "python_step_ms": 0.6, "twin_step_ms": 1.0}},
    },
    "dashboard": {
        "benchmark": "dashboard",
        "concurrency": 8,
        "results": [{"mode": m, "step_ms": 5.0, "best_step_ms": 4.8} for m in ("off", "1 Hz")],
    },
    "kernels": {
        "benchmark": "kernels",
        "shape": {"n": 64, "k": 256},
        "batch_sizes": [1, 16],
        "block_types": ["Q4_0", "int8"],
        "float32_peak_gflops": 90.0,
        "machine": {"native_isa": "avx512-vnni"},
        "torch": [
            {"m": m, "float32_gflops": 20.0 * m, "bfloat16_gflops": 10.0 * m} for m in (1, 16)
        ],
        "results": [
            {"block_type": b, "m": m, "gflops": 50.0 * m} for b in ("Q4_0", "int8") for m in (1, 16)
        ],
    },
}


def test_every_benchmark_has_a_plotter():
    assert set(RESULTS) == set(PLOTTERS)


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_figures_from_each_benchmark(name, tmp_path):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(RESULTS[name]))
    assert benchmark_of(RESULTS[name]) == name
    written = plot_file(str(path), str(tmp_path / "plots"))
    assert written
    for figure in written:
        with open(figure, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert figure.split("/")[-1].startswith(name)
