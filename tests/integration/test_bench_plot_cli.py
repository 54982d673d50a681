"""`plait bench serving ... --plot DIR` against a tiny server: the JSON, then figures beside it."""

from __future__ import annotations

import json

import pytest

from tests.integration.server_support import tiny_server

pytest.importorskip("matplotlib")


def test_bench_serving_writes_plots(tiny_llama_dir, tmp_path, capsys):
    from plait.cli import main

    out, plots = tmp_path / "serving.json", tmp_path / "plots"
    with tiny_server(tiny_llama_dir) as srv:
        argv = [
            "bench",
            "serving",
            "--url",
            srv.url,
            "--num-prompts",
            "6",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--concurrency",
            "1,3",
            "--max-duration",
            "30",
            "--output",
            str(out),
            "--plot",
            str(plots),
        ]
        assert main(argv) == 0
    (entry,) = json.loads(out.read_text())
    assert all(len(r["samples"]["ttft_ms"]) == 6 for r in entry["runs"])
    assert all(r["samples"]["itl_ms"] for r in entry["runs"])
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["serving-itl.png", "serving-throughput.png", "serving-ttft.png"]
    assert "serving-ttft.png" in capsys.readouterr().out
