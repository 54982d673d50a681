"""The one place that decides which kernel implementation runs.

- `use_triton(tensor)`: Triton kernels run on CUDA tensors when triton imports and
  `PLAIT_DISABLE_TRITON=1` is not set; everything else runs the torch reference.
- `launch(kernel, grid, like=tensor)`: a Triton kernel on CUDA, or the same kernel in Triton's
  interpreter on CPU tensors (how the tests check kernels on a machine without a GPU).
- `use_flash_attn(tensor)` / `flash_attn_varlen_func()`: flash-attn's varlen prefill, imported
  lazily on first use.
- Native CPU kernels (C++ in `csrc/`, built by `native.load`): float32 CPU tensors go to them when
  the library builds and `PLAIT_DISABLE_NATIVE=1` was not set at import; each module says so
  itself (`attention_cpu.use_native_attention`, `quant_matmul.native_quant_available`,
  `cpu_fused.usable`), since each falls back to its own torch reference.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from functools import cache
from typing import Any

import torch

from plait import environment

DISABLE_TRITON_ENV = environment.DISABLE_TRITON

try:
    import triton
except ImportError:  # Linux-only wheels; the torch references need nothing else
    triton = None


def triton_disabled() -> bool:
    return environment.current().disable_triton


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the fast kernels should handle this tensor: CUDA, triton installed, not
    disabled."""
    return tensor.is_cuda and triton is not None and not triton_disabled()


@cache
def flash_attn_varlen_func() -> Any:
    """flash-attn's `flash_attn_varlen_func` when the package imports (it needs a CUDA build)."""
    try:
        from flash_attn import flash_attn_varlen_func as fn
    except Exception:  # ImportError, or an ABI mismatch against the installed torch
        return None
    return fn


def use_flash_attn(tensor: torch.Tensor) -> bool:
    """True when prefill may go to flash-attn: fp16/bf16 CUDA tensors, the package importable, and
    the fast kernels not disabled."""
    return (
        use_triton(tensor)
        and tensor.dtype in (torch.float16, torch.bfloat16)
        and flash_attn_varlen_func() is not None
    )


# Triton's interpreter on CPU tensors ----------------------------------------------------------

_interpreter_lock = threading.Lock()


@cache
def _interpreted(fn: Any) -> Any:
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


@contextlib.contextmanager
def _interpreting() -> Iterator[None]:
    """Runs `@triton.jit` functions (ours and triton.language's own: tl.sum, tl.rand, ...) in the
    interpreter, whatever TRITON_INTERPRET said when triton was imported.

    NOTE: this patches `JITFunction.__call__` for the duration of one launch, under a lock; it is
    meant for tests and debugging on CPU, never for the serving path.
    """
    from triton.runtime.jit import JITFunction

    with _interpreter_lock:
        old_call = JITFunction.__call__
        old_env = os.environ.get("TRITON_INTERPRET")
        JITFunction.__call__ = lambda self, *a, **k: _interpreted(self.fn)(*a, **k)
        triton.knobs.runtime.interpret = True
        try:
            yield
        finally:
            JITFunction.__call__ = old_call
            del triton.knobs.runtime.interpret
            if old_env is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old_env


def launch(
    kernel: Any, grid: tuple[int, ...], like: torch.Tensor, *args: Any, **kwargs: Any
) -> None:
    """`kernel[grid](*args, **kwargs)`, compiled when `like` is a CUDA tensor, interpreted
    otherwise."""
    if triton is None:
        raise RuntimeError("triton is not installed: use the torch reference")
    if like.is_cuda:
        kernel[grid](*args, **kwargs)
        return
    with _interpreting():
        _interpreted(getattr(kernel, "fn", kernel))[grid](*args, **kwargs)


def is_interpreted(tensor: torch.Tensor) -> bool:
    """Kernels take a few interpreter-only detours (e.g. no bf16 `tl.dot`) on CPU tensors."""
    return not tensor.is_cuda
