"""Kernel part of the device check (`gpu_check.py`): each Triton kernel timed against its torch
reference (and flash-attn for prefill), and decode attention's bandwidth at 32k-token contexts as a
fraction of the device's copy bandwidth. `Sizes` says what runs: `Sizes()` on the GPU, `DRY` on a
CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.benchmarks.gpu_check_e2e import LLAMA_1B


@dataclass(frozen=True)
class Sizes:
    """What each section runs: `FULL` on the GPU; `DRY` checks this script on a CPU in seconds
    (kernels in Triton's interpreter, tiny shapes, no claims about speed)."""

    device: str = "cuda"
    copy_bytes: int = 2 * 1024**3
    decode_shapes: tuple = (
        ("llama-1B", 32, 8, 64),
        ("smollm2-135M", 9, 3, 64),
        ("8B-like", 32, 8, 128),
    )
    decode_batches: tuple = ((1, 32768, 16), (8, 32768, 16), (32, 32768, 16), (8, 32768, 1))
    split_sweep: tuple = (8, 16, 32, 64)
    block_sweep: tuple = (32, 128)
    ref_max_tokens: int = 8 * 32768
    extend_heads: tuple = (32, 8, 128)
    extend_cases: tuple = (
        ("prefill 1x4096", ((0, 4096),)),
        ("prefill 8x1024", ((0, 1024),) * 8),
        ("extend 4x(4096 cached + 256)", ((4096, 256),) * 4),
    )
    tokens: int = 8192
    hidden: int = 4096
    sample_shapes: tuple = ((64, 128256), (256, 49152))
    llama: dict = field(default_factory=lambda: dict(LLAMA_1B))
    e2e_requests: int = 64
    e2e_new_tokens: int = 128
    agreement_prompts: int = 8
    agreement_tokens: int = 64


DRY = Sizes(
    device="cpu",
    copy_bytes=1 << 20,
    decode_shapes=(("tiny", 4, 2, 64),),
    decode_batches=((2, 40, 16),),
    split_sweep=(2,),
    block_sweep=(32,),
    ref_max_tokens=1 << 20,
    extend_heads=(4, 2, 64),
    extend_cases=(("prefill 1x20", ((0, 20),)), ("extend 2x(16 cached + 5)", ((16, 5),) * 2)),
    tokens=8,
    hidden=64,
    sample_shapes=((4, 300),),
    llama=dict(
        LLAMA_1B,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    e2e_requests=2,
    e2e_new_tokens=4,
    agreement_prompts=1,
    agreement_tokens=4,
)


def bench_ms(fn: Callable[[], Any], device: str = "cuda") -> float:
    if device != "cuda":  # dry run: one timed call
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50))


# 2. kernel timings -------------------------------------------------------------------------------


def paged_layout(seqs: list[tuple[int, int]], page_size: int, device: str):
    """Slots of sequences given as (cached prefix, new tokens) over scattered pages."""
    pages = [-(-(p + n) // page_size) for p, n in seqs]
    perm = torch.randperm(sum(pages), device=device)
    slots, used = [], 0
    for (p, n), count in zip(seqs, pages):
        pos = torch.arange(p + n, device=device)
        slots.append(perm[used : used + count][pos // page_size] * page_size + pos % page_size)
        used += count
    return slots, sum(pages)


def decode_batch(sz: Sizes, batch: int, ctx: int, kv_heads: int, dim: int, page_size: int):
    """A decode batch as the model runner lays it out, plus the Triton page tables."""
    from plait.kernels.attention import AttentionMetadata
    from plait.kernels.attention_triton import triton_metadata_from

    slots, num_pages = paged_layout([(ctx - 1, 1)] * batch, page_size, sz.device)
    k_cache = torch.randn(
        num_pages, page_size, kv_heads, dim, device=sz.device, dtype=torch.bfloat16
    )
    lens = torch.full((batch,), ctx, device=sz.device)
    meta = AttentionMetadata(
        slot_mapping=torch.stack(slots)[:, -1],
        extend_q_starts=[],
        extend_q_lens=[],
        extend_kv_lens=[],
        extend_kv_slots=[],
        decode_kv_slots=torch.stack(slots),
        decode_kv_lens=lens,
        decode_mask=torch.ones(batch, 1, 1, ctx, dtype=torch.bool, device=sz.device),
    )
    return k_cache, torch.randn_like(k_cache), meta, triton_metadata_from(meta, page_size, kv_heads)


def copy_bandwidth(sz: Sizes) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(sz.copy_bytes, dtype=torch.uint8, device=sz.device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), sz.device)
    return 2 * sz.copy_bytes / (ms * 1e-3)


def decode_bandwidth_row(
    sz: Sizes, copy_bw: float, shape: tuple, batch: int, ctx: int, page_size: int
) -> dict:
    from plait.kernels.attention import decode_attention_ref
    from plait.kernels.attention_triton import decode_attention_triton

    name, heads, kv_heads, dim = shape
    kc, vc, meta, tables = decode_batch(sz, batch, ctx, kv_heads, dim, page_size)
    q = torch.randn(batch, heads, dim, device=sz.device, dtype=torch.bfloat16)
    scale = dim**-0.5
    bytes_read = 2 * batch * ctx * kv_heads * dim * kc.element_size()

    def triton_decode(splits: int, block_n: int) -> Callable[[], Any]:
        page_table, lens = tables.decode_page_table, tables.decode_kv_lens
        return lambda: decode_attention_triton(
            q, kc, vc, page_table, lens, scale, None, splits, block_n=block_n
        )

    chosen = (tables.num_kv_splits, 64)  # what serving uses: the heuristic, the default block
    variants = {
        chosen,
        *((s, 64) for s in sz.split_sweep),
        *((chosen[0], b) for b in sz.block_sweep),
    }
    timings = {v: bench_ms(triton_decode(*v), sz.device) for v in sorted(variants)}
    best = min(timings, key=timings.get)
    chosen_ms = timings[chosen]
    ref_ms = None
    if batch * ctx <= sz.ref_max_tokens:
        k_flat, v_flat = kc.view(-1, kv_heads, dim), vc.view(-1, kv_heads, dim)
        ref_ms = bench_ms(
            lambda: decode_attention_ref(
                q, k_flat, v_flat, meta.decode_kv_slots, meta.decode_mask, scale
            ),
            sz.device,
        )
    return {
        "model": name,
        "batch": batch,
        "context": ctx,
        "page": page_size,
        "splits": tables.num_kv_splits,
        "triton_ms": chosen_ms,
        "torch_ref_ms": ref_ms,
        "GB/s": bytes_read / (chosen_ms * 1e-3) / 1e9,
        "of_copy": bytes_read / (chosen_ms * 1e-3) / copy_bw,
        "best_splits,block": f"{best[0]},{best[1]}",
        "best_of_copy": bytes_read / (timings[best] * 1e-3) / copy_bw,
    }


def decode_bandwidth_rows(sz: Sizes, copy_bw: float) -> list[dict[str, Any]]:
    rows = []
    for shape in sz.decode_shapes:
        for batch, ctx, page_size in sz.decode_batches:
            rows.append(decode_bandwidth_row(sz, copy_bw, shape, batch, ctx, page_size))
            if sz.device == "cuda":
                torch.cuda.empty_cache()
    return rows


def extend_row(sz: Sizes, label: str, seqs: tuple) -> dict[str, Any]:
    from plait.kernels.attention import AttentionMetadata, paged_attention
    from plait.kernels.attention_triton import (
        extend_attention_triton,
        prefill_attention_flash,
        triton_metadata_from,
    )
    from plait.kernels.dispatch import use_flash_attn

    heads, kv_heads, dim = sz.extend_heads
    page_size, dev = 16, sz.device
    slots, num_pages = paged_layout(list(seqs), page_size, dev)
    kc = torch.randn(num_pages, page_size, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q_lens = [n for _, n in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.cat([s[p:] for s, (p, _) in zip(slots, seqs)]),
        extend_q_starts=[sum(q_lens[:i]) for i in range(len(seqs))],
        extend_q_lens=q_lens,
        extend_kv_lens=[p + n for p, n in seqs],
        extend_kv_slots=slots,
    )
    tables = triton_metadata_from(meta, page_size, kv_heads)
    q = torch.randn(sum(q_lens), heads, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(sum(q_lens), kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scale = dim**-0.5
    entry = {"case": label, "tokens": sum(q_lens)}
    entry["triton_ms"] = bench_ms(lambda: extend_attention_triton(q, kc, vc, tables, scale), dev)
    entry["torch_ref_ms"] = bench_ms(lambda: paged_attention(q, k, v, kc, vc, meta, scale), dev)
    if tables.extends_have_no_prefix and use_flash_attn(q):
        entry["flash_attn_ms"] = bench_ms(
            lambda: prefill_attention_flash(q, k, v, tables, scale), dev
        )
    return entry


def extend_rows(sz: Sizes) -> list[dict[str, Any]]:
    return [extend_row(sz, label, seqs) for label, seqs in sz.extend_cases]


def timing_row(
    dev: str, name: str, triton_fn: Callable, ref_fn: Callable, **baselines: Callable
) -> dict:
    entry = {
        "kernel": name,
        "triton_ms": bench_ms(triton_fn, dev),
        "torch_ref_ms": bench_ms(ref_fn, dev),
    }
    entry.update({key: bench_ms(fn, dev) for key, fn in baselines.items()})
    return entry


def sampling_rows(dev: str, batch: int, vocab: int) -> list[dict[str, Any]]:
    from plait.kernels.constraint_mask import apply_token_bitmask_ref, apply_token_bitmask_triton
    from plait.kernels.sampling_triton import exponential_noise, sample_ref, sample_triton
    from plait.runtime.protocol import SamplingParams
    from plait.runtime.sampling import SamplingRow, sample

    logits = torch.randn(batch, vocab, device=dev) * 3
    temp = torch.full((batch,), 0.8, device=dev)
    top_k, top_p = torch.full((batch,), 50, device=dev), torch.full((batch,), 0.9, device=dev)
    no_k, no_p = torch.full((batch,), vocab, device=dev), torch.ones(batch, device=dev)
    min_p = torch.zeros(batch, device=dev)
    noise = exponential_noise(batch, vocab, [None] * batch, None, dev)
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32, device=dev)
    srows = [
        SamplingRow(SamplingParams(temperature=0.8, top_k=50, top_p=0.9), [], [], [], None)
    ] * batch
    return [
        timing_row(
            dev,
            f"sample top-k/p {batch}x{vocab}",
            lambda: sample_triton(logits, temp, top_k, top_p, min_p, noise=noise, bitmask=bitmask),
            lambda: sample_ref(logits, temp, top_k, top_p, min_p, noise, bitmask),
            runtime_sample_ms=lambda: sample(logits.clone(), srows),
        ),
        timing_row(
            dev,
            f"sample temperature {batch}x{vocab}",
            lambda: sample_triton(logits, temp, no_k, no_p, min_p, noise=noise),
            lambda: sample_ref(logits, temp, no_k, no_p, min_p, noise),
        ),
        timing_row(
            dev,
            f"bitmask {batch}x{vocab}",
            lambda: apply_token_bitmask_triton(logits, bitmask),
            lambda: apply_token_bitmask_ref(logits, bitmask),
        ),
    ]


def small_kernel_rows(sz: Sizes) -> list[dict[str, Any]]:
    from plait.kernels.attention import write_kv
    from plait.kernels.attention_triton import store_kv_triton
    from plait.kernels.norm_rope import (
        fused_add_rms_norm_ref,
        fused_add_rms_norm_triton,
        rms_norm_ref,
        rms_norm_triton,
        rotary_ref,
        rotary_triton,
    )

    dev, bf16, tokens, hidden = sz.device, torch.bfloat16, sz.tokens, sz.hidden
    rows = []

    def add(name: str, triton_fn: Callable, ref_fn: Callable) -> None:
        rows.append(timing_row(dev, name, triton_fn, ref_fn))

    k = torch.randn(tokens, 8, 128, device=dev, dtype=bf16)
    kc = torch.empty(tokens // 4, 16, 8, 128, device=dev, dtype=bf16)
    slots = torch.randperm(tokens * 4, device=dev)[:tokens]
    add(
        f"store_kv {tokens} tok",
        lambda: store_kv_triton(k, k, kc, kc, slots),
        lambda: write_kv(k, k, kc, kc, slots),
    )
    x = torch.randn(tokens, hidden, device=dev, dtype=bf16)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device=dev, dtype=bf16)
    add(
        f"rms_norm {tokens}x{hidden}",
        lambda: rms_norm_triton(x, w, 1e-5),
        lambda: rms_norm_ref(x, w, 1e-5),
    )
    add(
        f"add+rms_norm {tokens}x{hidden}",
        lambda: fused_add_rms_norm_triton(x, res, w, 1e-5),
        lambda: fused_add_rms_norm_ref(x, res, w, 1e-5),
    )
    qkv = torch.randn(tokens, (32 + 16) * 128, device=dev, dtype=bf16)
    q = qkv[:, : 32 * 128].view(tokens, 32, 128)
    cos, sin = (
        torch.randn(tokens, 128, device=dev, dtype=bf16),
        torch.randn(tokens, 128, device=dev, dtype=bf16),
    )
    add(
        f"rotary q {tokens}x32x128",
        lambda: rotary_triton(q, cos, sin),
        lambda: rotary_ref(q, cos, sin),
    )
    for batch, vocab in sz.sample_shapes:
        rows.extend(sampling_rows(dev, batch, vocab))
    return rows
