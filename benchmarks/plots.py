"""`plait bench ... --plot DIR`: figures from a benchmark's JSON (matplotlib: `plait[bench]`).

One function per benchmark, each reading the JSON its `run_*_bench` writes and saving PNGs into
DIR named `<benchmark>-<figure>.png`: throughput against concurrency, TTFT / inter-token latency
distributions, decode speed against the roofline, the radix cache on and off, constrained against
free generation, and so on. `python -m plait.benchmarks.plots FILE.json... --out DIR` plots
results written earlier.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

Figure = Any
COLORS = ("#3d5a80", "#e76f51", "#2a9d8f", "#9b5de5", "#f4a261", "#8d99ae")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib: pip install 'plait[bench]' ({e})") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Figure, out_dir: str, name: str, written: list[str]) -> None:
    path = os.path.join(out_dir, name + ".png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    written.append(path)


def _bars(ax: Any, labels: list[str], groups: dict[str, list[float | None]], unit: str) -> None:
    """Grouped bars: one group per label, one bar per series of `groups`."""
    width = 0.8 / max(len(groups), 1)
    for i, (series, values) in enumerate(groups.items()):
        xs = [j + i * width - 0.4 + width / 2 for j in range(len(labels))]
        ax.bar(xs, [v or 0 for v in values], width, label=series, color=COLORS[i % len(COLORS)])
    ax.set_xticks(range(len(labels)), labels, rotation=20 if len(labels) > 4 else 0)
    ax.set_ylabel(unit)
    if len(groups) > 1:
        ax.legend()


# one function per benchmark --------------------------------------------------------------------


def plot_serving(data: Any, out: str, prefix: str = "serving") -> list[str]:
    plt, written = _pyplot(), []
    servers = data if isinstance(data, list) else [data]
    runs_of = [
        (s["label"], r) for s in servers for r in sorted(s["runs"], key=lambda r: r["concurrency"])
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, s in enumerate(servers):
        runs = sorted(s["runs"], key=lambda r: r["concurrency"])
        ax.plot(
            [r["concurrency"] for r in runs],
            [r["output_tok_s"] for r in runs],
            "o-",
            label=s["label"],
            color=COLORS[i % len(COLORS)],
        )
    ax.set(
        xscale="log", xlabel="concurrency", ylabel="output tok/s", title="throughput vs concurrency"
    )
    ax.legend()
    _save(fig, out, f"{prefix}-throughput", written)
    for key, title in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency")):
        fig, ax = plt.subplots(figsize=(6, 4))
        samples = [
            (f"{label}\nc={r['concurrency']}", r.get("samples", {}).get(key))
            for label, r in runs_of
        ]
        if all(v for _, v in samples):
            ax.boxplot([v for _, v in samples], showfliers=False)
            ax.set_xticks(range(1, len(samples) + 1), [n for n, _ in samples])
        else:  # results written before the samples were kept: mean, median and P99 only
            for i, stat in enumerate(("median", "mean", "p99")):
                ax.plot(
                    range(len(samples)),
                    [r[key][stat] for _, r in runs_of],
                    "o-",
                    label=stat,
                    color=COLORS[i],
                )
            ax.set_xticks(range(len(samples)), [n for n, _ in samples])
            ax.legend()
        ax.set(yscale="log", ylabel="ms", title=f"{title} (distribution per run)")
        _save(fig, out, f"{prefix}-{key.removesuffix('_ms')}", written)
    return written


def plot_throughput(data: Any, out: str) -> list[str]:
    plt, written = _pyplot(), []
    res = data["results"]
    plait = sorted(res["random"], key=lambda r: r["concurrency"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [r["concurrency"] for r in plait],
        [r["output_tok_s"] for r in plait],
        "o-",
        label="plait (continuous batching)",
        color=COLORS[0],
    )
    if res.get("transformers"):
        hf = sorted(res["transformers"], key=lambda r: r["batch_size"])
        ax.plot(
            [r["batch_size"] for r in hf],
            [r["output_tok_s"] for r in hf],
            "s--",
            label="transformers (static batch)",
            color=COLORS[1],
        )
    ax.set(
        xscale="log",
        xlabel="concurrency / batch size",
        ylabel="output tok/s",
        title="throughput vs concurrency",
    )
    ax.legend()
    _save(fig, out, "throughput-concurrency", written)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [r["concurrency"] for r in plait],
        [r["steps_s"] for r in plait],
        "o-",
        label="decode steps/s",
        color=COLORS[0],
    )
    ax.axhline(data["roofline_steps_s"], color=COLORS[1], ls="--", label="roofline (weights read)")
    ax.set(
        xscale="log",
        xlabel="concurrency",
        ylabel="steps/s",
        title="decode steps against the roofline",
    )
    ax.legend()
    _save(fig, out, "throughput-roofline", written)
    if res.get("shared_prefix"):
        fig, ax = plt.subplots(figsize=(5, 4))
        runs = res["shared_prefix"]
        _bars(
            ax,
            [f"cache {r['cache']}" for r in runs],
            {"seconds": [r["seconds"] for r in runs]},
            "seconds (lower is better)",
        )
        ax.set_title("shared prefix: radix cache on / off")
        _save(fig, out, "throughput-cache", written)
    return written


def plot_latency(data: Any, out: str) -> list[str]:
    plt, written = _pyplot(), []
    res = data["results"]
    formats = [f for f, r in res.items() if isinstance(r, dict) and "plait" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    groups: dict[str, list[float | None]] = {
        "plait": [res[f]["plait"]["decode_tok_s"] for f in formats],
        "roofline": [res[f]["roofline_steps_s"] for f in formats],
    }
    if any(res[f].get("transformers") for f in formats):
        groups["transformers"] = [
            (res[f].get("transformers") or {}).get("decode_tok_s") for f in formats
        ]
    _bars(ax, formats, groups, "decode tok/s (one stream)")
    if "llama_cpp" in res:
        ax.axhline(res["llama_cpp"]["decode_tok_s"], color=COLORS[4], ls="--", label="llama.cpp")
        ax.legend()
    ax.set_title("decode tok/s against the roofline")
    _save(fig, out, "latency-roofline", written)
    return written


def plot_programs(data: Any, out: str) -> list[str]:
    plt, written = _pyplot(), []
    results = data["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    systems = list(dict.fromkeys(r["system"] for r in results))
    by = {(r["workload"], r["system"]): r for r in results}
    fig, ax = plt.subplots(figsize=(7, 4))
    _bars(
        ax,
        workloads,
        {s: [(by.get((w, s)) or {}).get("programs_per_s") for w in workloads] for s in systems},
        "programs/s",
    )
    ax.set_title("programs: radix cache on / off")
    _save(fig, out, "programs-cache", written)
    return written


def plot_json(data: Any, out: str) -> list[str]:
    plt, written = _pyplot(), []
    res = data["results"]
    runs = [n for n in ("unconstrained", "jump-forward on", "jump-forward off") if n in res]
    fig, ax = plt.subplots(figsize=(6, 4))
    _bars(
        ax,
        runs,
        {"output tok/s": [res[n]["output_tokens"] / res[n]["seconds"] for n in runs]},
        "output tok/s",
    )
    ax.set_title("JSON schema: constrained vs free")
    _save(fig, out, "json-constrained", written)
    if "steps" in res:
        fig, ax = plt.subplots(figsize=(5, 4))
        st = res["steps"]
        _bars(
            ax,
            ["free", "constrained"],
            {"step ms": [st["unconstrained_step_ms"], st["constrained_step_ms"]]},
            "decode step ms",
        )
        ax.set_title("decode step: constrained vs free")
        _save(fig, out, "json-step", written)
    return written


def plot_jsonschema(data: Any, out: str) -> list[str]:
    """Outcomes per backend and budget (of all schemas sampled), and decode tok/s constrained
    against free at batch 1 and 16."""
    plt, written = _pyplot(), []
    backends = data["backends"]
    total = data["num_schemas"]
    labels, groups = [], {"valid": [], "of which closed early": [], "truncated": [], "refused": []}
    for name, entry in backends.items():
        for budget, counts in entry["by_budget"].items():
            labels.append(f"{name} @{budget}")
            groups["valid"].append(counts["valid"] + counts["closed_valid"])
            groups["of which closed early"].append(counts["closed_valid"])
            groups["truncated"].append(counts["truncated"])
            groups["refused"].append(round(total * (1 - entry["coverage"])))
    fig, ax = plt.subplots(figsize=(7, 4))
    _bars(ax, labels, groups, f"schemas (of {total})")
    ax.set_title("JSONSchemaBench sample: outcomes")
    _save(fig, out, "jsonschema-outcomes", written)
    speed = {
        (n, b): e[f"decode_b{b}"]
        for n, e in backends.items()
        for b in (1, 16)
        if isinstance(e.get(f"decode_b{b}"), dict)
    }
    if speed:
        fig, ax = plt.subplots(figsize=(6, 4))
        keys = list(speed)
        _bars(
            ax,
            [f"{n} b{b}" for n, b in keys],
            {
                "free": [speed[k]["free"] for k in keys],
                "constrained": [speed[k]["constrained"] for k in keys],
            },
            "output tok/s",
        )
        ax.set_title("decode: constrained vs free")
        _save(fig, out, "jsonschema-decode", written)
    return written


def plot_speculative(data: Any, out: str) -> list[str]:
    plt, written = _pyplot(), []
    results = data["results"]
    cases = list(dict.fromkeys(f"{r['workload']} b={r['batch']}" for r in results))
    algos = list(dict.fromkeys(r["algorithm"] for r in results))
    by = {(f"{r['workload']} b={r['batch']}", r["algorithm"]): r["decode_tok_s"] for r in results}
    fig, ax = plt.subplots(figsize=(7, 4))
    _bars(ax, cases, {a: [by.get((c, a)) for c in cases] for a in algos}, "decode tok/s")
    ax.set_title("speculative decoding by drafter")
    _save(fig, out, "speculative", written)
    return written


def plot_data_parallel(data: Any, out: str) -> list[str]:
    plt, written = _pyplot(), []
    runs = data["runs"]
    names = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    _bars(
        axes[0], names, {"output tok/s": [runs[n]["output_tok_s"] for n in names]}, "output tok/s"
    )
    _bars(
        axes[1], names, {"hit rate": [runs[n]["cache_hit_rate"] for n in names]}, "cache hit rate"
    )
    fig.suptitle("data parallelism: cache-aware routing")
    _save(fig, out, "data-parallel", written)
    return written


def plot_llama_cpp(data: Any, out: str) -> list[str]:
    converted = {}
    for r in data["results"]:
        converted.setdefault(r["server"], {"label": r["server"], "runs": []})["runs"].append(r)
    return plot_serving(list(converted.values()), out, prefix="llama-cpp")


def plot_overhead(data: Any, out: str) -> list[str]:
    plt, written = _pyplot(), []
    res = data["results"]
    formats = list(res)
    fig, ax = plt.subplots(figsize=(6, 4))
    _bars(
        ax,
        formats,
        {
            "step": [res[f]["step_ms"] for f in formats],
            "kernels stubbed": [res[f]["python_step_ms"] for f in formats],
            "skinny twin": [res[f]["twin_step_ms"] for f in formats],
        },
        "ms per decode step",
    )
    ax.set_title("what a decode step spends outside the arithmetic")
    _save(fig, out, "overhead", written)
    return written


def plot_dashboard(data: Any, out: str) -> list[str]:
    plt, written = _pyplot(), []
    res = data["results"]
    fig, ax = plt.subplots(figsize=(5, 4))
    _bars(
        ax,
        [r["mode"] for r in res],
        {"median": [r["step_ms"] for r in res], "best": [r["best_step_ms"] for r in res]},
        "ms per decode step",
    )
    ax.set_title(f"watching /dashboard ({data['concurrency']} streams)")
    _save(fig, out, "dashboard-cost", written)
    return written


PLOTTERS: dict[str, Callable[[Any, str], list[str]]] = {
    "serving": plot_serving,
    "throughput": plot_throughput,
    "latency": plot_latency,
    "programs": plot_programs,
    "json": plot_json,
    "jsonschema": plot_jsonschema,
    "speculative": plot_speculative,
    "data-parallel": plot_data_parallel,
    "llama-cpp": plot_llama_cpp,
    "overhead": plot_overhead,
    "dashboard": plot_dashboard,
    "kernels": lambda data, out: _plot_kernels(data, out),
}


def _plot_kernels(data: Any, out: str) -> list[str]:
    from plait.benchmarks.kernels import plot_kernels

    return plot_kernels(data, out, _save)


_NAMES = {"llama_cpp": "llama-cpp", "data_parallel": "data-parallel"}


def benchmark_of(data: Any) -> str | None:
    """Which benchmark wrote `data`: its `benchmark` field, else its shape."""
    if isinstance(data, list) or (isinstance(data, dict) and "label" in data and "runs" in data):
        return "serving"
    if not isinstance(data, dict):
        return None
    if "benchmark" in data:
        return _NAMES.get(data["benchmark"], data["benchmark"])
    if isinstance(data.get("runs"), dict):
        return "data-parallel"
    return None


def plot_file(path: str, out_dir: str, workload: str | None = None) -> list[str]:
    """Plots one benchmark JSON into `out_dir`; returns the files written."""
    with open(path) as f:
        data = json.load(f)
    name = workload or benchmark_of(data)
    if name not in PLOTTERS:
        raise SystemExit(f"--plot: no figures for {path} (benchmark {name!r})")
    os.makedirs(out_dir, exist_ok=True)
    written = PLOTTERS[name](data, out_dir)
    for p in written:
        print(f"wrote {p}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plait.benchmarks.plots", description=__doc__)
    parser.add_argument("files", nargs="+", help="benchmark JSON files")
    parser.add_argument("--out", required=True, help="folder for the figures")
    args = parser.parse_args(argv)
    for path in args.files:
        plot_file(path, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
