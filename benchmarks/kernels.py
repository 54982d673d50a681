"""`plait bench kernels`: the quantized matmul's GFLOP/s per block type and number of rows of x.

For each block type the CPU kernels run (GGUF's Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K and the
`int8` / `int4` formats plait quantizes to) and each batch size M (rows of x: 1 is single-stream
decode, 4-64 decode batches and verification steps, 512 a prefill chunk), `quant_matmul` on an
[M, K] x [N, K] product, beside torch's float32 and bfloat16 `F.linear` on the same product (the
weights dequantized), and two measured roofs:

- *memory*: the GFLOP/s at which the product would run if it cost only a plain read of its
  weights' bytes where they lie (`kernels/roofs.py`), 2 M N K over that read's time; it
  bounds small M, where each weight is used M times per read;
- *float32 peak*: torch's float32 GEMM on a large square product, the float roof of these cores.

`--compare-library PATH` also times the same products through another build of the kernels (a
`cpu_kernels-*.so`, e.g. built from another commit's `kernels/csrc`), interleaved with this one's
and both called straight through ctypes (`direct` and `compared`: no Python around the call, which
`quant_matmul` adds to every figure of the first column), so that a change to the kernels is
measured side by side in one run.

GFLOP/s counts 2 M N K per product, whatever the arithmetic inside (the int8 kernels do two
integer dot products per weight, for x's two int8 levels). Each figure is the best of a few timed
runs (`common.best_of`): on a machine shared with other work, compare columns of one run.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.benchmarks.common import best_of, print_table, write_json

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "int8", "int4")
BATCH_SIZES = (1, 4, 16, 64, 512)


def add_kernels_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--block-types",
        default=",".join(BLOCK_TYPES),
        help="comma-separated block types (default: all)",
    )
    parser.add_argument(
        "--batch-sizes",
        default=",".join(map(str, BATCH_SIZES)),
        help="comma-separated rows of x (default: 1,4,16,64,512)",
    )
    parser.add_argument(
        "--shape",
        default="1536x1024",
        help="N x K of the weight matrix; K a multiple of 256 for the k-quants",
    )
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=0.15,
        help="time each figure for at least this long (default: 0.15)",
    )
    parser.add_argument(
        "--cpu-threads", type=int, default=None, help="torch threads (default: all)"
    )
    parser.add_argument(
        "--compare-library",
        default=None,
        metavar="PATH",
        help="another build of the kernels to time beside this one (default: none)",
    )
    parser.add_argument(
        "--output", default="bench-results/kernels.json", help="JSON file of the results"
    )


def block_weight(kind: str, n: int, k: int, seed: int = 0) -> Any:
    """An [n, k] `QuantizedWeight` of `kind`: GGUF blocks quantized by `gguf` where it can (else
    random bytes with valid scales), or plait's own int8 (per channel) / int4 quantization."""
    from plait.kernels.quant_weights import quantize_int4, quantize_int8
    from plait.runtime.model_loader.gguf_blocks import quantized_blocks

    if kind in ("int8", "int4"):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
        return quantize_int8(w) if kind == "int8" else quantize_int4(w)
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(seed)
    try:
        raw = gguf.quants.quantize(rng.normal(0, 0.05, (n, k)).astype(np.float32), qtype)
    except NotImplementedError:  # gguf quantizes the legacy types only
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8) & np.uint8(0xBF)
    return quantized_blocks(kind, raw, n, k)


def library_matmul(path: str) -> Any:
    """`quant_matmul`'s native call through the build at `path`: fn(x, qw) -> y."""
    import ctypes

    from plait.kernels.quant_matmul import call_native_matmul

    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library = Path(path).resolve()  # a bare file name is not searched for on the library path
    if not library.is_file():
        raise SystemExit(f"--compare-library: no such file {path!r}")
    fn = ctypes.CDLL(str(library)).plait_qmatmul_f32
    fn.argtypes, fn.restype = [p, i64, i64, i64, p, c_int, i64, p, p, p, p, c_int], None

    def matmul(x: torch.Tensor, qw: Any) -> torch.Tensor:
        return call_native_matmul(fn, x, qw)

    return matmul


def _seconds(fn: Any, min_seconds: float) -> float:
    """The best time of one call of `fn`, over enough calls to fill `min_seconds` (at least 3)."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    return best_of(fn, max(3, min(200, int(min_seconds / once))))


def _gflops(m: int, n: int, k: int, seconds: float) -> float:
    return 2.0 * m * n * k / seconds / 1e9


def float32_peak(min_seconds: float) -> float:
    """torch's float32 GEMM on a 2048^3 product, GFLOP/s."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return _gflops(2048, 2048, 2048, _seconds(lambda: torch.mm(a, b), min_seconds))


def run_kernels_bench(args: argparse.Namespace) -> int:
    from plait.kernels import roofs
    from plait.kernels.quant_matmul import QuantMatmul, native_isa, quant_matmul

    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    kinds = [s for s in args.block_types.split(",") if s]
    unknown = sorted(set(kinds) - set(BLOCK_TYPES))
    if unknown:
        raise SystemExit(f"--block-types: unknown {unknown}; choose from {', '.join(BLOCK_TYPES)}")
    sizes = [int(s) for s in args.batch_sizes.split(",") if s]
    n, k = (int(v) for v in args.shape.lower().split("x"))
    for kind in kinds:  # a block type's rows hold whole blocks (256 weights for the k-quants)
        block = 256 if kind.endswith("_K") else 32
        if k % block:
            raise SystemExit(f"--shape: K = {k} is not a multiple of {block}, as {kind} needs")
    print(
        f"quantized matmul [M, {k}] x [{n}, {k}], native kernels: {native_isa()}, "
        f"{torch.get_num_threads()} threads"
    )
    peak = float32_peak(args.min_seconds)
    gen = torch.Generator().manual_seed(1)
    xs = {m: torch.randn(m, k, generator=gen) for m in sizes}
    w32 = torch.randn(n, k, generator=gen) * 0.05
    w16 = w32.to(torch.bfloat16)
    torch_rows = []
    for m in sizes:
        x, x16 = xs[m], xs[m].to(torch.bfloat16)
        f32 = _seconds(partial(torch.nn.functional.linear, x, w32), args.min_seconds)
        bf16 = _seconds(partial(torch.nn.functional.linear, x16, w16), args.min_seconds)
        torch_rows.append(
            {
                "m": m,
                "float32_gflops": _gflops(m, n, k, f32),
                "bfloat16_gflops": _gflops(m, n, k, bf16),
            }
        )
    float32_read = roofs.read_seconds([w32])
    other = this = None
    if args.compare_library:  # both builds through the same ctypes call, with no Python around it
        from plait.kernels import native

        other, this = (
            library_matmul(args.compare_library),
            library_matmul(str(native.build("cpu_kernels"))),
        )
    results, table = [], []
    for kind in kinds:
        qw = block_weight(kind, n, k)
        parts = [t for t in (qw.qweight, qw.scales, qw.mins) if t is not None]
        read = roofs.read_seconds(parts)
        for m, ref in zip(sizes, torch_rows):
            x = xs[m]
            seconds = _seconds(partial(quant_matmul, x, qw), args.min_seconds)
            compared = None
            if other is not None:  # interleaved: this build, the other, this one again
                ours = _seconds(partial(this, x, qw), args.min_seconds)
                compared = _seconds(partial(other, x, qw), args.min_seconds)
                ours = min(ours, _seconds(partial(this, x, qw), args.min_seconds))
            row = {
                "block_type": kind,
                "m": m,
                "n": n,
                "k": k,
                "weight_bytes": qw.nbytes,
                "int8_activations": QuantMatmul(qw).rounds_to_int8(m),
                "path": QuantMatmul(qw).path(m),
                "seconds": seconds,
                "gflops": _gflops(m, n, k, seconds),
                "memory_roof_gflops": _gflops(m, n, k, read) if read else None,
                "torch_float32_gflops": ref["float32_gflops"],
                "torch_bfloat16_gflops": ref["bfloat16_gflops"],
                "compared_gflops": _gflops(m, n, k, compared) if compared else None,
                "direct_gflops": _gflops(m, n, k, ours) if compared else None,
            }
            results.append(row)
            table.append(
                [
                    kind,
                    m,
                    row["gflops"],
                    row["direct_gflops"],
                    row["compared_gflops"],
                    row["memory_roof_gflops"],
                    row["torch_float32_gflops"],
                    row["torch_bfloat16_gflops"],
                    row["path"],
                ]
            )
    headers = [
        "block type",
        "M",
        "GFLOP/s",
        "direct",
        "compared",
        "memory roof",
        "torch f32",
        "torch bf16",
        "path",
    ]
    print_table(headers, table)
    print(f"float32 GEMM peak (2048^3): {peak:.1f} GFLOP/s")
    # float32 weights' own memory roof, for the torch columns
    f32_roof = {m: _gflops(m, n, k, float32_read) if float32_read else None for m in sizes}
    write_json(
        args.output,
        {
            "benchmark": "kernels",
            "shape": {"n": n, "k": k},
            "batch_sizes": sizes,
            "block_types": kinds,
            "compare_library": args.compare_library,
            "float32_peak_gflops": peak,
            "float32_memory_roof_gflops": f32_roof,
            "torch": torch_rows,
            "results": results,
        },
    )
    return 0


def plot_kernels(data: dict[str, Any], out: str, save: Any) -> list[str]:
    """GFLOP/s against M (log-log), one line per block type, torch's float32 and bfloat16 dashed,
    the float32 peak dotted."""
    from plait.benchmarks.plots import COLORS, _pyplot

    plt, written = _pyplot(), []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = data["batch_sizes"]
    for i, kind in enumerate(data["block_types"]):
        rows = sorted((r for r in data["results"] if r["block_type"] == kind), key=lambda r: r["m"])
        ax.plot(
            [r["m"] for r in rows],
            [r["gflops"] for r in rows],
            marker="o",
            label=kind,
            color=COLORS[i % len(COLORS)],
            linestyle="-" if i < len(COLORS) else "-.",
        )
    for key, label in (("float32_gflops", "torch float32"), ("bfloat16_gflops", "torch bfloat16")):
        ax.plot(sizes, [r[key] for r in data["torch"]], "k--" if "32" in key else "k:", label=label)
    ax.axhline(data["float32_peak_gflops"], color="grey", linewidth=0.8, label="float32 GEMM peak")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows of x (M)")
    ax.set_ylabel("GFLOP/s")
    shape = data["shape"]
    ax.set_title(
        f"quantized matmul, N={shape['n']} K={shape['k']} ({data['machine']['native_isa']})"
    )
    ax.legend(fontsize=7, ncol=2)
    save(fig, out, "kernels-gflops", written)
    return written
