"""The OpenMP teams of threads other than the engine's (`csrc/cpu_threads.cpp`).

libgomp keeps a team of worker threads for each thread that ever opened a parallel region and,
once the threads it manages outnumber the CPUs, throttles every team's spin-wait: each parallel
region of the engine's steps then wakes its workers through a futex. A parallel torch op on the
thread that later submits requests (a user's own tensor work before creating an `Engine`, a
model loaded on the main thread) is enough. The engine releases the team of the thread that
builds it and of each thread that submits (`release_thread_team`), loads its model on a
short-lived thread (`runtime/engine_setup.py: off_main_thread`), and its loop thread releases its
own team whenever it goes idle, so that one engine's idle workers do not throttle another's.
"""

from __future__ import annotations

import ctypes
from functools import cache

from plait.kernels import native


@cache
def _release() -> ctypes._CFuncPtr | None:
    return native.function("cpu_kernels", "plait_release_thread_team", [], ctypes.c_int)


def release_thread_team() -> bool:
    """Frees the calling thread's OpenMP team, if it has one (never from inside a parallel
    region); False where the native library is unavailable or the call was refused."""
    fn = None if native.native_disabled() else _release()
    return fn is not None and fn() == 0
