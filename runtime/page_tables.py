"""Requests' page tables as tensors, for the model runner: the slots each token's KV lives in, in
the pool's pages or, for the sliding layers of a model that has them, in their window pages.

A page the window no longer reaches has no window page (`WindowPages.of` is -1 there): its slots
read as the window pool's page 0, which every attention path leaves out through the layer's
window, so the value read there is never used.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from plait.kernels import attention_cpu
from plait.kernels.attention import AttentionMetadata
from plait.radix_cache import WindowPages
from plait.runtime.request import Request


class PageRows:
    """Each live request's page table as an int64 tensor with room to grow, brought up to date in
    place: only pages appended since the last sync, or from the request's `KVState.
    pages_stale_from` (lowered by the KV cache manager where it replaces or drops pages), are
    copied. One instance serves every runner that reads the same page tables (the target's and a
    draft model's), since a sync consumes the stale mark. A finished request's buffer goes with
    it."""

    def __init__(self) -> None:
        self._rows: weakref.WeakKeyDictionary[Request, tuple[torch.Tensor, int]] = (
            weakref.WeakKeyDictionary()
        )

    def table(self, req: Request) -> torch.Tensor:
        """`req.kv.pages` as int64 [num_pages].

        NOTE: only pages appended or marked stale are copied: rebuilding it from the list every
        step would cost O(context) per request and step.
        """
        pages, n = req.kv.pages, len(req.kv.pages)
        buf, synced = self._rows.get(req, (None, 0))
        start = min(synced, req.kv.pages_stale_from, n)
        if buf is None or buf.numel() < n:
            grown = torch.empty(max(64, 2 * n), dtype=torch.long)
            if start:
                grown[:start] = buf[:start]
            buf = grown
        if start < n:
            buf[start:n] = torch.from_numpy(
                np.fromiter(pages[start:n], dtype=np.int64, count=n - start)
            )
        self._rows[req] = (buf, n)
        req.kv.pages_stale_from = n
        return buf[:n]


class PageTables:
    def __init__(
        self,
        page_size: int,
        device: torch.device,
        window: WindowPages | None,
        rows: PageRows | None = None,
        attention: str = "torch",
    ) -> None:
        """`rows`: the page-table buffers, shared with another runner over the same pages.
        `attention`: who attends (`Execution.attention`), which settles what each layout adds for
        its kernels."""
        self.page_size = page_size
        self.device = device
        self.rows = rows if rows is not None else PageRows()
        self.attention = attention
        # shares memory with the scheduler's map (an `array`): always current, never copied
        self.window_of = (
            torch.frombuffer(window.of, dtype=torch.int64) if window is not None else None
        )

    def page_table(self, req: Request) -> torch.Tensor:
        """`req.kv.pages` as an int64 tensor (`PageRows.table`)."""
        return self.rows.table(req)

    def slots(self, req: Request, start: int, end: int) -> torch.Tensor:
        """KV slots of token positions [start, end) of a request (a view of its page table when
        pages hold one token: copy it before the table changes)."""
        table = self.page_table(req)
        if self.page_size == 1:
            return table[start:end]
        positions = torch.arange(start, end, dtype=torch.long)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The same positions' slots in the window pages (0 where a page has none)."""
        assert self.window_of is not None
        if self.page_size == 1:
            return self.window_of[slots].clamp_(min=0)
        pages = self.window_of[slots // self.page_size]
        return torch.where(pages >= 0, pages * self.page_size + slots % self.page_size, 0)

    def window_pages(self, pages: list[int]) -> list[int]:
        assert self.window_of is not None
        return [max(int(self.window_of[p]), 0) for p in pages]

    def layout(
        self,
        extends: list[tuple[Request, int, int, int]],
        decodes: list[Request],
        *,
        window: bool,
        rows_window: int | None,
        num_kv_heads: int,
        bf16_extends: bool,
        batch_invariant: bool = False,
    ) -> AttentionMetadata:
        """The step's attention layout. `extends`: (request, first position, end, first row of the
        flat batch) per extend or verify entry; `decodes`: one token each, after them. `window`:
        in the window pages; `rows_window`: the window the CPU rows are first built for."""
        convert = self.window_slots if window else None
        slot_chunks: list[torch.Tensor] = []
        q_starts, q_lens, kv_lens, kv_slots = [], [], [], []
        for req, start, end, row0 in extends:
            all_slots = self.slots(req, 0, end)
            if convert is not None:
                all_slots = convert(all_slots)
            slot_chunks.append(all_slots[start:])
            q_starts.append(row0)
            q_lens.append(end - start)
            kv_lens.append(end)
            kv_slots.append(all_slots)
        decode_slots = decode_lens = None
        if decodes:
            lens = [r.num_tokens for r in decodes]
            table = torch.zeros(len(lens), max(lens), dtype=torch.long)
            for i, r in enumerate(decodes):
                s = self.slots(r, 0, lens[i])
                table[i, : lens[i]] = s if convert is None else convert(s)
                slot_chunks.append(table[i, lens[i] - 1 : lens[i]])
            decode_slots = table.to(self.device)
            decode_lens = torch.tensor(lens, dtype=torch.long).to(self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_chunks).to(self.device),
            extend_q_starts=q_starts,
            extend_q_lens=q_lens,
            extend_kv_lens=kv_lens,
            extend_kv_slots=[s.to(self.device) for s in kv_slots],
            decode_kv_slots=decode_slots,
            decode_kv_lens=decode_lens,
            bf16_extends=bf16_extends,
            batch_invariant=batch_invariant,
        )
        if self.attention == "native":
            meta.cpu = attention_cpu.cpu_rows(meta, rows_window)
        elif self.attention == "triton":
            from plait.kernels.attention_triton import tables_from_pages

            pages = self.window_pages if window else list
            meta.triton = tables_from_pages(
                self.page_size,
                num_kv_heads,
                self.device,
                extend_pages=[pages(r.kv.pages) for r, *_ in extends],
                extend_q_lens=q_lens,
                extend_kv_lens=kv_lens,
                decode_pages=[pages(r.kv.pages) for r in decodes],
                decode_kv_lens=[r.num_tokens for r in decodes],
            )
        return meta
