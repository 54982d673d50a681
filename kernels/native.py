"""Native CPU kernels: C++ sources in `kernels/csrc/`, compiled on first use, loaded with ctypes.

The sources include nothing from torch (plain C ABI over raw pointers), so a build takes about a
second with the system C++ compiler. The shared object is cached under
`$PLAIT_CACHE_DIR/native` (default `~/.cache/plait/native`), keyed by a hash of the source, the
flags, the compiler and the CPU, so a machine never loads code built for another CPU.

`load(name)` returns the `ctypes.CDLL`, or None when the kernels are unavailable: not Linux/x86,
no compiler, a build error (logged once), or `PLAIT_DISABLE_NATIVE=1`. Every caller keeps a torch
fallback, so a machine without a compiler is slower, never broken.

NOTE: the sources use OpenMP. torch is imported first, so `libgomp.so.1` resolves to the runtime
torch already loaded: one thread pool, no oversubscription between the two.
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
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before ours)

logger = logging.getLogger(__name__)

DISABLE_NATIVE_ENV = "PLAIT_DISABLE_NATIVE"
CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno"]

_lock = threading.Lock()


def native_disabled() -> bool:
    return os.environ.get(DISABLE_NATIVE_ENV, "") in ("1", "true", "yes")


def cache_dir() -> Path:
    root = os.environ.get("PLAIT_CACHE_DIR") or os.path.join(Path.home(), ".cache", "plait")
    return Path(root) / "native"


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
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@cache
def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(name: str) -> Path:
    """Compiles `csrc/{name}.cpp` (or returns the cached build); raises on failure."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    source = CSRC / f"{name}.cpp"
    text = source.read_bytes()
    key = hashlib.sha256(
        b"\0".join([text, " ".join(FLAGS).encode(), _compiler_version(cxx).encode(), _cpu_key().encode()])
    ).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run(
            [cxx, *FLAGS, str(source), "-o", str(tmp_out)], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise RuntimeError(f"building {source.name} failed:\n{proc.stderr[-4000:]}")
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
