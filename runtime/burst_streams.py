"""Streams fed from inside a decode burst.

A burst (`BurstRunner.run`) runs many decode steps in one native call. Left alone, a
streaming request in it would get its tokens in one clump when the call returns. Instead the
kernel calls back on the engine thread between steps (the same call that fills grammar masks,
`kernels/decode_stack.py: BurstMasks`), and `BurstStreams.before_step` hands on the tokens the
previous step picked for each streaming request: appended through the output processor (text,
stop strings, length) and delivered to the request's sink. The last step's tokens come with the
call's return, a moment later.

NOTE: a request finished here (a stop token or string, its length) is not delivered here: the
engine thread delivers it after the step's pages are released, as it does every final result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from plait.runtime.batch import TokenResult
from plait.runtime.output_processor import OutputProcessor
from plait.runtime.request import Request


@dataclass
class StreamedTokens:
    """What the streams did for one request during a burst."""

    taken: int = 0  # tokens of the request's row handed on (the engine thread skips them)
    added: int = 0  # of those, tokens the output processor appended before the request finished


class BurstStreams:
    """The streaming rows of one burst; `before_step` is its between-steps callback."""

    def __init__(
        self,
        rows: list[tuple[int, Request]],
        out: np.ndarray,
        processor: OutputProcessor,
        deliver: Callable[[Request], None],
    ) -> None:
        """`rows`: (row of `out`, its streaming request); `out`: the burst's tokens, [B, steps]
        int64, a step's column written once the step has picked."""
        self._rows = rows
        self._out = out
        self._processor = processor
        self._deliver = deliver
        self._every_row = len(rows) == out.shape[0]
        self.streamed: dict[Request, StreamedTokens] = {r: StreamedTokens() for _, r in rows}

    def before_step(self, step: int) -> bool:
        """Hands on the tokens of step `step - 1`; True ends the burst here (every row streams
        and every one has finished: nobody waits for the rest)."""
        if step == 0:
            return False
        finished = 0
        for row, req in self._rows:
            got = self.streamed[req]
            if req.finished:
                finished += 1
                continue
            token = int(self._out[row, step - 1])
            # NOTE: counted as taken once appended: if appending raises, the engine thread
            # appends it again after the call, and the failure goes through its own recovery
            got.added += self._processor.append_tokens(req, TokenResult(tokens=[token]))
            got.taken = step
            if req.finished:
                finished += 1
            else:
                self._deliver(req)
        return self._every_row and finished == len(self._rows)
