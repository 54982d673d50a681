"""Every environment variable plait reads, parsed and checked in one place.

Configuration proper is frozen dataclasses (`runtime/config.py`) built by the CLI; the variables
here are switches below that level, for the kernels and their build, which a user sets around a
whole process:

| variable | values | default | effect |
|---|---|---|---|
| `PLAIT_DISABLE_NATIVE` | `1` / `0` | `0` | never build or call the native CPU kernels (the torch references run) |
| `PLAIT_NATIVE_MARCH` | a `-march` target | `native` | the CPU the native kernels are built for (`haswell`: the AVX2 paths) |
| `PLAIT_CACHE_DIR` | a directory | `~/.cache/plait` | where built kernels are cached (under `native/`) |
| `PLAIT_BF16_GEMM` | `1` / `0` / `auto` | `auto` | prefill-shaped quantized matmuls in bfloat16 (off unless `1`: faster prefill on AMX tiles or AVX-512 BF16, at the cost of bfloat16 rounding) |
| `PLAIT_DISABLE_TRITON` | `1` / `0` | `0` | CUDA tensors take the torch references instead of the Triton kernels |
| `CXX` | a compiler | `c++`, then `g++` | the C++ compiler of the native kernels |

Booleans accept `1/true/yes/on` and `0/false/no/off` (any case); anything else is an error that
names the variable. `current()` reads the process environment once, on first use, since some
callers ask per layer; `reload()` reads it again (tests, and benchmarks that flip a variable
between runs in one process).

NOTE: stdlib only, so that every layer, `kernels/` included, may import it.
"""  # noqa: E501

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DISABLE_NATIVE = "PLAIT_DISABLE_NATIVE"
NATIVE_MARCH = "PLAIT_NATIVE_MARCH"
CACHE_DIR = "PLAIT_CACHE_DIR"
BF16_GEMM = "PLAIT_BF16_GEMM"
DISABLE_TRITON = "PLAIT_DISABLE_TRITON"
CXX = "CXX"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}: expected 1/true/yes/on or 0/false/no/off, got {env[name]!r}")


def _tristate(env: Mapping[str, str], name: str) -> bool | None:
    if env.get(name, "").strip().lower() == "auto":
        return None
    return _flag(env, name) if env.get(name, "").strip() else None


@dataclass(frozen=True)
class Environment:
    disable_native: bool = False
    native_march: str = "native"
    cache_dir: Path = Path.home() / ".cache" / "plait"
    bf16_gemm: bool | None = None  # None or False: off (kernels/quant_matmul.py: bf16_gemm_enabled)
    disable_triton: bool = False
    cxx: str | None = None  # None: the first of c++, g++ on PATH

    def __post_init__(self) -> None:
        if not self.native_march or any(c.isspace() for c in self.native_march):
            raise ValueError(
                f"{NATIVE_MARCH}: expected one -march target, got {self.native_march!r}"
            )

    @classmethod
    def from_mapping(cls, env: Mapping[str, str]) -> Environment:
        cache_dir = env.get(CACHE_DIR, "").strip()
        return cls(
            disable_native=_flag(env, DISABLE_NATIVE),
            native_march=env.get(NATIVE_MARCH, "").strip() or "native",
            cache_dir=Path(cache_dir).expanduser()
            if cache_dir
            else Path.home() / ".cache" / "plait",
            bf16_gemm=_tristate(env, BF16_GEMM),
            disable_triton=_flag(env, DISABLE_TRITON),
            cxx=env.get(CXX, "").strip() or None,
        )


_current: Environment | None = None


def current() -> Environment:
    """The process environment's settings, read on the first call."""
    global _current
    if _current is None:
        _current = Environment.from_mapping(os.environ)
    return _current


def reload() -> Environment:
    """Reads the process environment again; later `current()` calls return the new settings.

    NOTE: values already taken at import stay as they were (`kernels.native.DISABLED`, the build
    flags of a loaded library)."""
    global _current
    _current = Environment.from_mapping(os.environ)
    return _current
