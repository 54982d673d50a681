"""`plait bench jsonschema` on a two-category folder shaped like JSONSchemaBench's data/: coverage,
compile and mask times, and each schema's outcome in the JSON."""

from __future__ import annotations

import importlib.util
import json


def test_bench_jsonschema_reports_each_schema(tiny_llama_dir, tmp_path):
    from plait.cli import main

    data = tmp_path / "data"
    (data / "Easy").mkdir(parents=True)
    (data / "Hard").mkdir()
    (data / "Easy" / "flag.json").write_text(
        json.dumps(
            {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
        )
    )
    (data / "Hard" / "refused.json").write_text(
        json.dumps({"type": "string", "not": {"pattern": "^a"}})
    )
    out, plots = tmp_path / "jsonschema.json", tmp_path / "plots"
    argv = [
        "bench",
        "jsonschema",
        "--model",
        str(tiny_llama_dir),
        "--data",
        str(data),
        "--per-category",
        "1",
        "--max-tokens",
        "24",
        "--backends",
        "llguidance",
        "--no-speed",
        "--output",
        str(out),
    ]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(plots)]
    assert main(argv) == 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert sorted(p.name for p in plots.iterdir()) == ["jsonschema-outcomes.png"]
    report = json.loads(out.read_text())
    entry = report["backends"]["llguidance"]
    assert entry["coverage"] == 0.5
    (refused,) = entry["refused"]
    assert (
        refused.startswith("Hard/refused.json: UnsupportedSchemaError") and "'not' at #" in refused
    )
    (outcome,) = entry["outcomes"]["24"]
    assert outcome["schema"] == "Easy/flag.json"
    assert outcome["kind"] in ("valid", "closed_valid")  # a tiny random model, but it parses
