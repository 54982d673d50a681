"""Vocabulary bitmasks for constrained decoding: allocation, torch reference, Triton kernel,
dispatch.

A bitmask is `[batch, ceil(vocab_size / 32)]` int32: bit `t % 32` of word `t // 32` is 1 when
token `t` is allowed. Row `i` of the bitmask belongs to row `i` of the logits; `indices` lists the
rows that are constrained, every other row is left untouched. Tokens at or past `32 * num_words`
(a model vocabulary wider than the mask) are disallowed in constrained rows.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence
from functools import cache, partial
from typing import Any

import numpy as np
import torch

from plait.kernels.dispatch import use_triton
from plait.kernels.tuning import MASK_BLOCK_SIZE

BITS_PER_WORD = 32


def num_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_token_bitmask(
    batch_size: int,
    vocab_size: int,
    *,
    device: torch.device | str = "cpu",
    pin_memory: bool = False,
) -> torch.Tensor:
    """A `[batch_size, ceil(vocab_size / 32)]` int32 bitmask with every token allowed (-1 words)."""
    if batch_size < 0 or vocab_size <= 0:
        raise ValueError(
            f"allocate_token_bitmask: batch_size={batch_size}, vocab_size={vocab_size}"
        )
    pin = pin_memory and torch.device(device).type == "cpu" and torch.cuda.is_available()
    return torch.full(
        (batch_size, num_bitmask_words(vocab_size)),
        -1,
        dtype=torch.int32,
        device=device,
        pin_memory=pin,
    )


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(
            f"apply_token_bitmask: logits and bitmask must be 2-D, got {tuple(logits.shape)} and "
            f"{tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"apply_token_bitmask: bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"apply_token_bitmask: bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]}"
        )


def _as_indices(
    indices: torch.Tensor | Sequence[int] | None, device: torch.device
) -> torch.Tensor | None:
    if indices is None or isinstance(indices, torch.Tensor):
        return None if indices is None else indices.to(device=device, dtype=torch.long)
    return torch.tensor(list(indices), dtype=torch.long, device=device)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | Sequence[int] | None = None
) -> None:
    """In place: logits[r, t] = -inf where bit t of bitmask[r] is 0, for each r in `indices` (all
    rows if None)."""
    _check(logits, bitmask)
    rows = _as_indices(indices, logits.device)
    if rows is not None and rows.numel() == 0:
        return
    vocab_size = logits.shape[1]
    words = bitmask if rows is None else bitmask.index_select(0, rows.to(bitmask.device))
    words = words.to(logits.device)
    shifts = torch.arange(BITS_PER_WORD, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [rows, num_words * 32]
    if allowed.shape[1] >= vocab_size:
        allowed = allowed[:, :vocab_size]
    else:
        pad = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits.index_copy_(
            0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
        )


try:
    import triton
    import triton.language as tl
except ImportError:  # Linux-only wheels; the torch reference needs nothing else
    triton = None

_BLOCK_SIZE = MASK_BLOCK_SIZE

if triton is not None:

    def _apply_token_bitmask_kernel(
        logits_ptr,
        bitmask_ptr,
        indices_ptr,
        vocab_size,
        num_words,
        logits_stride,
        bitmask_stride,
        HAS_INDICES: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        # grid: (constrained rows, vocabulary blocks); one program masks BLOCK_SIZE logits of a row
        pid_row = tl.program_id(0)
        pid_block = tl.program_id(1)
        if HAS_INDICES:
            row = tl.load(indices_ptr + pid_row).to(tl.int64)
        else:
            row = pid_row.to(tl.int64)
        tokens = pid_block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_vocab = tokens < vocab_size
        words = tokens // 32
        packed = tl.load(
            bitmask_ptr + row * bitmask_stride + words, mask=in_vocab & (words < num_words), other=0
        )
        blocked = ((packed >> (tokens % 32)) & 1) == 0
        tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=in_vocab & blocked)


@cache
def _triton_kernel(interpret: bool) -> Any:
    """The kernel, jitted for the GPU or wrapped by Triton's interpreter (CPU tensors)."""
    if triton is None:
        raise RuntimeError("apply_token_bitmask_triton: triton is not installed")
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_apply_token_bitmask_kernel)
    return triton.jit(_apply_token_bitmask_kernel)


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | Sequence[int] | None = None
) -> None:
    """Same contract as `apply_token_bitmask_ref`; CPU tensors run in Triton's interpreter."""
    _check(logits, bitmask)
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_bitmask_triton: logits and bitmask rows must be contiguous")
    rows = _as_indices(indices, logits.device)
    num_rows = logits.shape[0] if rows is None else rows.numel()
    if num_rows == 0:
        return
    bitmask = bitmask.to(logits.device)
    vocab_size, num_words = logits.shape[1], bitmask.shape[1]
    grid = (num_rows, (vocab_size + _BLOCK_SIZE - 1) // _BLOCK_SIZE)
    kernel = _triton_kernel(not logits.is_cuda)
    kernel[grid](
        logits,
        bitmask,
        rows if rows is not None else bitmask,  # unused when HAS_INDICES is False
        vocab_size,
        num_words,
        logits.stride(0),
        bitmask.stride(0),
        HAS_INDICES=rows is not None,
        BLOCK_SIZE=_BLOCK_SIZE,
    )


_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)


@cache
def _native_rows() -> Any:
    from plait.kernels import native

    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return native.function(
        "cpu_kernels", "plait_apply_bitmask_rows", [p, i64, i64, p, i64, p, i64, ctypes.c_int]
    )


def apply_token_bitmask_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | Sequence[int] | None = None
) -> None:
    """Same contract on CPU tensors: the native kernel for float32 rows (`csrc/cpu_sampling.cpp`,
    which skips the all-allowed words, so a mostly open mask costs little), else numpy
    (`unpackbits` unpacks the bits faster than torch shifts do)."""
    from plait.kernels import native

    _apply_cpu(
        not native.native_disabled() and _native_rows() is not None, logits, bitmask, indices
    )


def _apply_cpu(
    native_rows: bool,
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | Sequence[int] | None,
) -> None:
    """`apply_token_bitmask_cpu`, with the native kernel's use settled (`native_rows`)."""
    _check(logits, bitmask)
    if (
        native_rows
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.stride(1) == 1
        and bitmask.device.type == "cpu"
        and bitmask.is_contiguous()
    ):
        rows = list(range(logits.shape[0])) if indices is None else [int(i) for i in indices]
        if not rows:
            return
        if min(rows) < 0 or max(rows) >= logits.shape[0]:
            raise IndexError(
                f"apply_token_bitmask: row index out of range for {logits.shape[0]} rows"
            )
        index = torch.tensor(rows, dtype=torch.long)
        _native_rows()(
            logits.data_ptr(),
            logits.stride(0),
            logits.shape[1],
            bitmask.data_ptr(),
            bitmask.shape[1],
            index.data_ptr(),
            len(rows),
            min(torch.get_num_threads(), len(rows)),
        )
        return
    if (
        logits.device.type != "cpu"
        or logits.dtype not in _NUMPY_DTYPES
        or sys.byteorder != "little"
    ):
        apply_token_bitmask_ref(logits, bitmask, indices)
        return
    rows = None if indices is None else [int(i) for i in indices]
    if rows is not None and not rows:
        return
    vocab_size = logits.shape[1]
    out, words = logits.numpy(), bitmask.cpu().numpy()
    words = words if rows is None else words[rows]
    # bit t of a row, padded with 0 (blocked) past the mask: [rows, vocab_size]
    blocked = np.unpackbits(words.view(np.uint8), axis=1, count=vocab_size, bitorder="little") == 0
    if rows is None:
        np.copyto(out, -np.inf, where=blocked)
    else:
        for row, row_blocked in zip(rows, blocked):
            np.copyto(out[row], -np.inf, where=row_blocked)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | Sequence[int] | None = None
) -> None:
    """Mask the constrained rows of `logits` in place: Triton on CUDA tensors
    (`dispatch.use_triton`), numpy on CPU (chosen per call, for callers outside an engine:
    `choose_bitmask_apply` settles it once)."""
    if use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask, indices)
    elif logits.is_cuda:
        apply_token_bitmask_ref(logits, bitmask, indices)
    else:
        apply_token_bitmask_cpu(logits, bitmask, indices)


BitmaskApply = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | Sequence[int] | None"], None]


def choose_bitmask_apply(device: torch.device) -> BitmaskApply:
    """The kernel that masks logits on `device`, chosen once (an engine's `StepTokens` holds it):
    Triton on CUDA where it runs, torch's reference elsewhere off the CPU; on the CPU the native
    rows where the library built, else numpy (`apply_token_bitmask_cpu`)."""
    probe = torch.empty(0, device=device)
    if use_triton(probe):
        return apply_token_bitmask_triton
    if device.type != "cpu":
        return apply_token_bitmask_ref
    from plait.kernels import native

    return partial(_apply_cpu, not native.native_disabled() and _native_rows() is not None)
