"""What `Engine.stats()` reports, read from an engine's parts: the KV pool and prefix cache, the
scheduler's queues and counters, the model and its weights, the execution chosen at start,
speculation, the KV tiers and handoff, and the totals."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.runtime.engine_setup import window_layers
from plait.runtime.kv_pool import KVPool

if TYPE_CHECKING:
    from plait.runtime.engine_core import EngineCore


def engine_stats(core: EngineCore) -> dict[str, Any]:
    """`Engine.stats()`, read on the caller's thread."""
    sched = core.scheduler
    total = core.allocator.num_total
    free = core.allocator.num_free
    cached = core.cache.total_size()
    return {
        "kv_pages_total": total,
        "kv_pages_free": free,
        "kv_pages_cached": cached,
        "kv_pages_evictable": core.cache.evictable_size(),
        "kv_pages_in_use": total - free - cached,
        "page_size": core.page_size,
        "num_running": sum(not r.finished for r in (*sched.running, *sched.prefilling)),
        "num_waiting": len(sched.all_requests()) - len(sched.running) - len(sched.prefilling),
        "cache_hit_rate": sched.cached_prompt_tokens / sched.prompt_tokens
        if sched.prompt_tokens
        else 0.0,
        "num_retracted": sched.num_retracted,
        "prompt_tokens_scheduled": sched.prompt_tokens,  # with cached_prompt_tokens: the hit rate
        "prompt_tokens_cached": sched.cached_prompt_tokens,
        "total_computed_tokens": sched.computed_tokens,
        **core.speculation.stats(),
        "new_token_ratio": sched.new_token_ratio,
        "quantization": core.config.model.quantization,
        "model_family": core.family,
        "weight_types": core.weight_types,
        "cpu_threads": core.threads.current if core.device.type == "cpu" else None,
        "weight_bytes": core.weight_bytes,
        "kv_cache_dtype": str(core.kv_dtype).removeprefix("torch."),
        "kv_bytes_per_token": KVPool.bytes_per_token(
            core.args.num_layers, core.args.num_kv_heads, core.args.head_dim, core.kv_dtype
        ),
        **_window_stats(core, total - free),
        **core.execution_stats,
        **(core.tiers.stats() if core.tiers is not None else {}),
        **(core.handoff.stats() if core.handoff is not None else {}),
        **{f"total_{k}": v for k, v in core.totals.items()},
    }


def _window_stats(core: EngineCore, pages_held: int) -> dict[str, int]:
    """The sliding layers' pages, and the bytes of KV held now (requests and cache, every
    layer): each held page in the full layers, each held window page in the sliding ones."""
    window, args = core.window, core.args
    per_page = core.page_size * KVPool.bytes_per_token(
        1, args.num_kv_heads, args.head_dim, core.kv_dtype
    )
    sliding = window_layers(args).count(True) if window is not None else 0
    held = pages_held * per_page * (args.num_layers - sliding)
    if window is None:
        return {"kv_bytes_held": held}
    return {
        "kv_window_pages_total": window.num_pages,
        "kv_window_pages_free": window.allocator.num_free,
        "kv_window_pages_evictable": window.available() - window.allocator.num_free,
        "kv_bytes_held": held + window.num_attached * per_page * sliding,
    }
