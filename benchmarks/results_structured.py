"""The structured-output sections of docs/results.md (JSONSchemaBench, and JSON extraction with
jump-forward), in the shape of `results_sections.py`'s renderers."""

from __future__ import annotations

from plait.benchmarks.results_sections import Report, pct, table, times


def jsonschema(r: Report) -> list[str]:
    n = r["num_schemas"]
    cover, outcome, speed = [], [], []
    for name, b in r["backends"].items():
        cover.append(
            [
                name,
                f"{round(b['coverage'] * n)}/{n}",
                b["compile_p50_ms"],
                b["compile_p99_ms"],
                b["mask_mean_us"],
                b["mask_p99_us"],
            ]
        )
        for budget, c in b["by_budget"].items():
            outcome.append(
                [
                    name,
                    budget,
                    f"**{c['valid'] + c['closed_valid']}/{n}**",
                    c["closed_valid"],
                    c["finished_invalid"],
                    c["closed_invalid"],
                    c["truncated"],
                ]
            )
        for key, value in b.items():
            if key.startswith("decode_") and isinstance(value, dict):
                schema, _, batch = key.removeprefix("decode_").rpartition("_")
                speed.append(
                    [
                        name,
                        f"{schema or 'strings'}, {batch[1:]}",
                        value["free"],
                        value["constrained"],
                        pct(value["constrained"] / value["free"]),
                    ]
                )
    lc = r.get("llama.cpp")
    if lc:
        cover.append(
            ["llama.cpp's server", f"{round(lc['coverage'] * n)}/{n}", None, None, None, None]
        )
        for budget, c in lc["by_budget"].items():
            outcome.append(
                [
                    "llama.cpp's server",
                    budget,
                    f"**{c['valid']}/{n}**",
                    None,
                    c["finished_invalid"],
                    None,
                    c["truncated"],
                ]
            )
    lines = [
        f"{n} schemas of [JSONSchemaBench](https://github.com/guidance-ai/jsonschemabench) "
        f"({r['per_category']} per category, seed {r['seed']}), one greedy request each; every "
        f"output validated against its schema with `jsonschema` (formats checked).",
        "",
        *table(
            [
                "backend",
                "covered",
                "compile p50 ms",
                "compile p99 ms",
                "mask mean µs",
                "mask p99 µs",
            ],
            cover,
        ),
        *table(
            [
                "backend",
                "max_tokens",
                "valid",
                "of which closed early",
                "finished invalid",
                "closed invalid",
                "truncated",
            ],
            outcome,
        ),
    ]
    if lc:
        lines += [
            "llama.cpp's server (llama-cpp-python, same GGUF, one request at a time) falls back "
            "to any-JSON output where it cannot convert a schema; its `covered` counts the "
            "schemas its converter takes, its `valid` every valid output.",
            "",
        ]
        lost = [
            f"{c.get('crashed', 0)} crashed its server and {c.get('failed', 0)} failed at "
            f"{budget} tokens"
            for budget, c in lc["by_budget"].items()
            if c.get("crashed") or c.get("failed")
        ]
        if lost:
            lines[-2] += (
                f" Of its requests, {'; '.join(lost)} (a segmentation fault; the "
                "benchmark starts a new server; a failed request is one sent while it was "
                "down or past the timeout)."
            )
    if speed:
        lines += [
            "Decode speed under a schema against free decoding of as many tokens (`strings`: a "
            "list of bounded strings; `records`: objects with forced keys):",
            "",
            *table(["backend", "schema, batch", "free tok/s", "constrained tok/s", "ratio"], speed),
        ]
    return lines


def json_extraction(r: Report) -> list[str]:
    res = r["results"]
    runs = {k: v for k, v in res.items() if isinstance(v, dict) and "seconds" in v}
    off = runs.get("jump-forward off")
    rows = [
        [
            name,
            v["output_tokens"] / v["seconds"],
            times(off["seconds"] / v["seconds"]) if off else "",
            v["jump_forward_tokens"],
            v["valid_json"],
        ]
        for name, v in runs.items()
    ]
    lines = ["Extraction requests under an 8-field schema, greedy, in one batch.", ""]
    if res.get("by_requests"):
        lines += [
            "Jump-forward on against off by request count: cold, every prompt prefilled; warm, the "
            "prompts already in the prefix cache, so the run is decoding alone.",
            "",
            *table(
                ["requests", "× cold", "× warm", "tokens jumped"],
                [
                    [
                        n,
                        times(e["speedup_cold"]),
                        times(e["speedup_warm"]),
                        f"{e['jump-forward on']['cold']['jump_forward_tokens']} of "
                        f"{e['jump-forward on']['cold']['output_tokens']}",
                    ]
                    for n, e in res["by_requests"].items()
                ],
            ),
        ]
    lines += [
        "The largest count, cold, beside unconstrained generation of the same lengths:",
        "",
        *table(["run", "output tok/s", "× jump-forward off", "tokens jumped", "valid JSON"], rows),
    ]
    if res.get("spacing"):
        rows = []
        for spacing, e in res["spacing"].items():
            a = e["accuracy"]
            rows.append(
                [
                    spacing,
                    f"{a['ages_right']}/{a['of']}",
                    f"{a['names_right']}/{a['of']}",
                    f"{a['cities_right']}/{a['of']}",
                    times(e["jf_off_s"] / e["jf_on_s"]),
                    f"{e['jumped']} of {e['output_tokens']}",
                ]
            )
        lines += [
            "By JSON spacing (`json_whitespace`): name, age and city extracted from twelve short "
            "paragraphs and checked against them; jump-forward's speedup on the largest "
            "count, cold.",
            "",
            *table(
                [
                    "spacing",
                    "ages right",
                    "names right",
                    "cities right",
                    "JF speedup",
                    "tokens jumped",
                ],
                rows,
            ),
        ]
    if "steps" in res and "mask" in res:
        st, m = res["steps"], res["mask"]
        lines += [
            f"A constrained decode step (jump-forward off) took "
            f"{st['constrained_step_ms']:.1f} ms against "
            f"{st['unconstrained_step_ms']:.1f} ms unconstrained "
            f"({st['constrained_step_overhead']:+.1%}); "
            f"a mask filled in {m['fill_us_mean']:.0f} µs per token "
            f"(P99 {m['fill_us_p99']:.0f} µs).",
            "",
        ]
    return lines
