"""Closing searches too long for the engine loop: run on a thread of their own while their
request sits out of the batches.

A closing found on the loop must take a few milliseconds (every running request waits for it),
which is enough for short closings but not for a deep JSON document that needs a hundred tokens to
close. Such a search runs here instead, on a copy of the request's grammar; the request keeps its
pages but is left out of decode batches (`Scheduler` skips it) until the search is done, so the
closing it finds is still the closing of its state. Other requests decode meanwhile.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from plait.runtime.request import Request
from plait.runtime.tuning import CLOSING_BACKGROUND_SECONDS


class ClosingJobs:
    def __init__(self) -> None:
        # its thread starts with the first job
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-closing")

    def start(self, req: Request, search: Any, room: int) -> None:
        """Looks for a closing of at most `room` tokens from `req`'s state; `req` waits."""
        probe = req.constraint.grammar.copy()  # type: ignore[union-attr]
        req.closing.job = self._pool.submit(
            search.shortest_completion, probe, room, time_limit=CLOSING_BACKGROUND_SECONDS
        )
        req.closing.job_at = len(req.output_ids)

    @staticmethod
    def done(reqs: list[Request]) -> list[Request]:
        return [r for r in reqs if r.closing.job is not None and r.closing.job.done()]

    @staticmethod
    def wait(reqs: list[Request], timeout: float) -> None:
        """Until one of `reqs`' searches is done, or `timeout` seconds."""
        jobs: list[Future] = [r.closing.job for r in reqs if r.closing.job is not None]
        if jobs:
            concurrent.futures.wait(
                jobs, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def close(self) -> None:
        """Cancels the searches not started; no job starts after it."""
        self._pool.shutdown(wait=False, cancel_futures=True)
