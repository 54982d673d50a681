"""Random paged-attention batches laid out as the model runner lays them out, shared by the
kernel tests (Triton and native CPU) that compare against the torch reference."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from plait.kernels.attention import AttentionMetadata


@dataclass
class Case:
    """A forward batch: extends as (cached prefix, new tokens), decodes as context lengths."""

    extends: list[tuple[int, int]]
    decodes: list[int]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None


def make_batch(case: Case, device: str = "cpu", seed: int = 0):
    """Random caches and new q/k/v, pages scattered over the pool, metadata as ModelRunner builds
    it."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    ps = case.page_size
    lens = [p + n for p, n in case.extends] + list(case.decodes)
    num_pages = sum(math.ceil(n / ps) for n in lens) + 3
    free = list(range(num_pages))
    rng.shuffle(free)
    tables = []
    for n in lens:
        tables.append([free.pop() for _ in range(math.ceil(n / ps))])

    def slots(table, start, end):
        pos = torch.arange(start, end)
        return torch.tensor(table, dtype=torch.long)[pos // ps] * ps + pos % ps

    shape = (num_pages, ps, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(case.dtype)
    v_cache = torch.randn(shape, generator=gen).to(case.dtype)
    num_tokens = sum(n for _, n in case.extends) + len(case.decodes)
    q = torch.randn(num_tokens, case.num_heads, case.head_dim, generator=gen).to(case.dtype)
    k = torch.randn(num_tokens, case.num_kv_heads, case.head_dim, generator=gen).to(case.dtype)
    v = torch.randn(num_tokens, case.num_kv_heads, case.head_dim, generator=gen).to(case.dtype)

    slot_chunks, q_starts, q_lens, kv_lens, kv_slots = [], [], [], [], []
    row = 0
    for (prefix, n), table in zip(case.extends, tables):
        all_slots = slots(table, 0, prefix + n)
        slot_chunks.append(all_slots[prefix:])
        q_starts.append(row)
        q_lens.append(n)
        kv_lens.append(prefix + n)
        kv_slots.append(all_slots.to(device))
        row += n
    decode_slots = decode_lens = decode_mask = None
    if case.decodes:
        width = max(case.decodes)
        table = torch.zeros(len(case.decodes), width, dtype=torch.long)
        for i, (n, pages) in enumerate(zip(case.decodes, tables[len(case.extends) :])):
            s = slots(pages, 0, n)
            table[i, :n] = s
            slot_chunks.append(s[-1:])
        decode_lens = torch.tensor(case.decodes)
        decode_mask = (torch.arange(width)[None, :] < decode_lens[:, None])[:, None, None, :]
        decode_slots, decode_lens, decode_mask = (
            table.to(device),
            decode_lens.to(device),
            decode_mask.to(device),
        )
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_chunks).to(device),
        extend_q_starts=q_starts,
        extend_q_lens=q_lens,
        extend_kv_lens=kv_lens,
        extend_kv_slots=kv_slots,
        decode_kv_slots=decode_slots,
        decode_kv_lens=decode_lens,
        decode_mask=decode_mask,
    )
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k), to(v), to(k_cache), to(v_cache), meta, tables


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {
        torch.float32: dict(atol=2e-5, rtol=1e-4),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
    }.get(dtype, dict(atol=1.6e-2, rtol=1.6e-2))
