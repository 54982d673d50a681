"""Native CPU kernels: C++ sources in `kernels/csrc/`, compiled on first use, loaded with ctypes.

The sources include nothing from torch (plain C ABI over raw pointers), so a build takes a few
seconds with the system C++ compiler. All kernels live in one library, `cpu_kernels`. They
parallelize with OpenMP (`csrc/parallel.h`); torch is imported first, so `libgomp.so.1` resolves to
the runtime torch already loaded, and the kernels share torch's threads. The shared object is cached
under `$PLAIT_CACHE_DIR/native` (default `~/.cache/plait/native`), keyed by a hash of the source,
the flags, the compiler and the CPU, so a machine never loads code built for another CPU.

The build targets the machine it runs on (`-march=native`), so the AVX-512 VNNI paths compile
where the CPU has them and the AVX2 ones elsewhere; `PLAIT_NATIVE_MARCH` names another target
(`haswell` builds the AVX2 paths on any x86-64 machine that runs them, as the tests do).

`load(name)` returns the `ctypes.CDLL`, or None when the kernels are unavailable: not Linux/x86,
no compiler, a build error (logged once), or `PLAIT_DISABLE_NATIVE=1`. Every caller keeps a torch
fallback, so a machine without a compiler is slower, never broken.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch  # noqa: F401  (loads torch's libgomp before ours)

from plait import environment

logger = logging.getLogger(__name__)

MARCH_ENV = environment.NATIVE_MARCH
CSRC = Path(__file__).parent / "csrc"
FLAGS = [
    "-O3",
    f"-march={environment.current().native_march}",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c++17",
    "-fno-math-errno",
]
# library name -> its sources (every header in csrc/ is part of each build's cache key)
LIBRARIES = {
    "cpu_kernels": (
        "cpu_abi.cpp",
        "cpu_attention.cpp",
        "cpu_extend_attention.cpp",
        "cpu_quant_matmul.cpp",
        "quant_matmul_float.cpp",
        "quant_matmul_avx2.cpp",
        "quant_matmul_vnni.cpp",
        "quant_matmul_vnni_int8.cpp",
        "dense_gemv.cpp",
        "cpu_fused.cpp",
        "cpu_decode.cpp",
        "cpu_roofs.cpp",
        "cpu_sampling.cpp",
        "cpu_threads.cpp",
    )
}

_lock = threading.Lock()


# Read once at import: the model asks several times per layer, and an environment lookup costs
# more than some of the kernels it guards. Tests flip `native.DISABLED` directly.
DISABLED = environment.current().disable_native


def native_disabled() -> bool:
    """`PLAIT_DISABLE_NATIVE=1` was set when plait was imported."""
    return DISABLED


def cache_dir() -> Path:
    return environment.current().cache_dir / "native"


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return environment.current().cxx or shutil.which("c++") or shutil.which("g++")


@cache
def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(name: str) -> Path:
    """Compiles library `name` (`LIBRARIES[name]`, or `csrc/{name}.cpp` alone) or returns the
    cached build; raises on failure."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    sources = [CSRC / f for f in LIBRARIES.get(name, (f"{name}.cpp",))]
    texts = [p.read_bytes() for p in sources] + [p.read_bytes() for p in sorted(CSRC.glob("*.h"))]
    key = hashlib.sha256(
        b"\0".join(
            [*texts, " ".join(FLAGS).encode(), _compiler_version(cxx).encode(), _cpu_key().encode()]
        )
    ).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run(
            [cxx, *FLAGS, *map(str, sources), "-o", str(tmp_out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"building {name} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent builder finds a whole file or none
    return out


@cache
def _load(name: str) -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64", "aarch64"):
        return None
    try:
        return ctypes.CDLL(str(build(name)))
    except Exception as exc:  # no compiler, a build error, a bad cache file
        logger.warning("native kernels %r unavailable, using torch: %s", name, exc)
        return None


def load(name: str) -> ctypes.CDLL | None:
    """The compiled library `name`, or None when native kernels are unavailable or disabled."""
    if native_disabled():
        return None
    with _lock:
        return _load(name)


def function(library: str, symbol: str, argtypes: Sequence[Any], restype: Any = None) -> Any:
    """`library`'s C function `symbol` with its signature set, or None as `load` would be."""
    lib = load(library)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


def _abi_function(symbol: str, nargs: int) -> Any:
    return function("cpu_kernels", symbol, [ctypes.c_char_p] * nargs, ctypes.c_int64)


def abi_constant(name: str) -> int | None:
    """A code or limit the library defines (`csrc/plait_kernels.h`, reported by `csrc/cpu_abi.cpp`):
    `format_int8`, `kv_bfloat16`, `q8_block`, `avx2_max_q8_rows`, ...; None without the library.
    Raises KeyError for a name the library does not define."""
    fn = _abi_function("plait_abi_constant", 1)
    if fn is None:
        return None
    value = fn(name.encode())
    if value < 0:
        raise KeyError(f"native ABI: no constant {name!r}")
    return int(value)


def abi_layout(struct: str, fields: Sequence[str]) -> tuple[int, dict[str, int]] | None:
    """The library's `sizeof(struct)` and `offsetof(struct, field)` for each field, as its compiler
    laid them out; None without the library. Raises KeyError for a name it does not know."""
    size_fn, offset_fn = (
        _abi_function("plait_abi_struct_size", 1),
        _abi_function("plait_abi_field_offset", 2),
    )
    if size_fn is None or offset_fn is None:
        return None
    size = size_fn(struct.encode())
    offsets = {f: offset_fn(struct.encode(), f.encode()) for f in fields}
    missing = [f for f, o in offsets.items() if o < 0] + ([struct] if size < 0 else [])
    if missing:
        raise KeyError(f"native ABI: {struct} has no {', '.join(missing)}")
    return int(size), {f: int(o) for f, o in offsets.items()}
