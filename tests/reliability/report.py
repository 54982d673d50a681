"""The tally every run adds to, its table, and the checks shared by the runs (leaks, health)."""

from __future__ import annotations

import gc
import json
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

COLUMNS = (
    "sent",
    "completed",
    "aborted",
    "refused",
    "timed_out",
    "failed",
    "lost",
    "leaks",
    "fuzz_cases",
    "crashes",
)


@dataclass
class Tally:
    """Outcomes of one run. `lost`: no final answer (no response, a connection error, a stream
    without [DONE]); `crashes`: a 5xx the input should not cause, a 400 that names no field, a
    wrong output, a hung or dead server, or a router that does not see a replica go or return."""

    name: str
    sent: int = 0
    completed: int = 0
    aborted: int = 0  # the client hung up or asked to abort
    refused: int = 0  # 503 (queue full), 4xx a hostile input deserves
    timed_out: int = 0  # 504: past its deadline
    failed: int = 0  # 500 for an injected fault, as expected
    lost: int = 0
    leaks: int = 0
    fuzz_cases: int = 0
    crashes: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def note(self, message: str) -> None:
        if len(self.notes) < 20:
            self.notes.append(message)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.leaks == 0 and self.crashes == 0


def count_status(tally: Tally, status: int, expected_failure: bool = False) -> None:
    tally.sent += 1
    if status == 200:
        tally.completed += 1
    elif status == 504:
        tally.timed_out += 1
    elif status == 500 and expected_failure:
        tally.failed += 1
    elif status >= 500 and status != 503:
        tally.crashes += 1
        tally.note(f"unexpected HTTP {status}")
    else:
        tally.refused += 1


def check_leaks(tally: Tally, server: Any, timeout: float = 30.0) -> dict[str, Any]:
    """Waits for the engine to go idle, then counts what is still held: pages in use, pages lost
    (free + cached != total), admission slots, a broken tree. Also checks health."""
    engine = server.engine
    deadline = time.monotonic() + timeout
    while engine.core.scheduler.has_work() or engine.stats()["kv_pages_in_use"]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    stats = engine.stats()
    problems = []
    if stats["kv_pages_in_use"]:
        problems.append(f"{stats['kv_pages_in_use']} KV pages still in use")
    if stats["kv_pages_free"] + stats["kv_pages_cached"] != stats["kv_pages_total"]:
        problems.append("free + cached != total pages")
    if engine.core.scheduler.has_work():
        problems.append("requests still queued or running")
    admission = server.app_state.admission
    if admission.in_flight or admission.live:
        problems.append(f"{admission.in_flight} admission slots still held")
    try:
        engine.core.scheduler.check()
    except AssertionError as e:
        problems.append(f"integrity: {e}")
    for p in problems:
        tally.note(p)
    tally.leaks += len(problems)
    try:
        healthy = httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    except httpx.HTTPError:
        healthy = False
    if not healthy:
        tally.crashes += 1
        tally.note("/health_generate failed afterwards")
    return stats


def rss_mb() -> float:
    """Resident memory now (Linux /proc), after a collection."""
    gc.collect()
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def table(tallies: list[Tally]) -> str:
    rows = [("run", *COLUMNS, "seconds")]
    for t in tallies:
        rows.append((t.name, *(str(getattr(t, c)) for c in COLUMNS), f"{t.seconds:.0f}"))
    total = Tally("total")
    for t in tallies:
        for c in (*COLUMNS, "seconds"):
            setattr(total, c, getattr(total, c) + getattr(t, c))
    rows.append((total.name, *(str(getattr(total, c)) for c in COLUMNS), f"{total.seconds:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_json(path: str | Path, tallies: list[Tally], config: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = [asdict(t) | {"ok": t.ok} for t in tallies]
    out.write_text(json.dumps({"config": config, "runs": runs}, indent=2, default=str))
