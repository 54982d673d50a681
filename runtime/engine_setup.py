"""What an engine settles before its loop starts: the device and dtype a configuration names, how
many KV pages fit, and loading off the main thread."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from plait.runtime.config import CacheConfig, SchedulerConfig
from plait.runtime.kv_pool import KVPool
from plait.runtime.tuning import (
    REWIND_SLACK_TOKENS,
    WINDOW_POOL_MIN_REQUESTS,
    WINDOW_POOL_MIN_SHARE,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # NOTE: CPUs without native bf16 run bf16 matmuls far slower than float32 ones.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "float16" and device.type == "cpu":
        raise ValueError("dtype: float16 is only supported on GPUs; use float32 or bfloat16")
    return _DTYPES[name]


def window_layers(args: Any) -> tuple[bool, ...]:
    """Which layers attend through the model's sliding window (their KV lives in window pages)."""
    return tuple(args.layer_window(i) is not None for i in range(args.num_layers))


def window_cap_tokens(args: Any, sc: SchedulerConfig, page_size: int) -> int:
    """The most positions one request holds window pages for: its window, a prefill chunk (or a
    burst of decode steps, or drafts) past it, the rewind slack, a page at each end."""
    ahead = max(sc.chunked_prefill_size, sc.num_continuous_decode_steps + 32)
    return args.sliding_window + ahead + REWIND_SLACK_TOKENS + 2 * page_size


def num_kv_pages(
    cc: CacheConfig,
    sc: SchedulerConfig,
    args: Any,
    kv_dtype: torch.dtype,
    device: torch.device,
    context_len: int,
) -> tuple[int, int]:
    """(pages of the pool, window pages of its sliding layers; 0 without any). The pool holds
    `max_total_tokens` when given, else a share of the device's free memory (GPU) or of RAM (CPU),
    between one context and 64 contexts. The window pages hold at least a few requests' windows
    and a quarter of the pool: they bound how many requests run at once, never what one may hold.
    """
    windowed = window_layers(args)
    per_layer = KVPool.bytes_per_token(1, args.num_kv_heads, args.head_dim, kv_dtype)
    per_full = per_layer * windowed.count(False)
    per_window = per_layer * windowed.count(True)

    def window_pages(pages: int) -> int:
        if not per_window:
            return 0
        cap = -(-window_cap_tokens(args, sc, cc.page_size) // cc.page_size)
        share = math.ceil(pages * WINDOW_POOL_MIN_SHARE)
        return min(pages, max(WINDOW_POOL_MIN_REQUESTS * cap, share))

    if cc.max_total_tokens is not None:
        pages = cc.max_total_tokens // cc.page_size
        return pages, window_pages(pages)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * (cc.mem_fraction_static or 0.8)
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = total * (cc.mem_fraction_static or 0.1)
    tokens = int(budget // (per_full + per_window * WINDOW_POOL_MIN_SHARE))
    tokens = max(min(tokens, 64 * context_len), context_len)
    pages = tokens // cc.page_size
    return pages, window_pages(pages)


def off_main_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs `fn(*args)` on a short-lived thread and returns its result (or raises its error).

    NOTE: libgomp throttles its spin-wait to ~100 iterations once it manages more threads than
    there are CPUs, and the main thread's OpenMP team counts even while it sleeps. Loading a model
    runs parallel torch ops; on the main thread that would leave a team behind and make every
    parallel op of the engine thread pay a futex wake-up, which costs a small op several times
    its work. A helper thread's team is freed when the thread exits.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="plait-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
