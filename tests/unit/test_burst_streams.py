"""`BurstStreams`: between a burst's steps (the kernel's callback, on the engine thread) each
streamed request gets the previous step's token as its own delivery; a request it finishes is left
to the engine thread; `streamed` says how many tokens of each row it took."""

from __future__ import annotations

import numpy as np

from plait.runtime.burst_streams import BurstStreams
from plait.runtime.protocol import FinishReason, SamplingParams
from plait.runtime.request import Delivery, Request, RequestStatus, SamplingState


class Processor:
    """Appends tokens; a request finishes at `stop`."""

    def __init__(self, stop: int = -1) -> None:
        self.stop = stop

    def append_tokens(self, req: Request, result) -> int:
        for j, token in enumerate(result.tokens):
            req.output_ids.append(token)
            if token == self.stop:
                req.finish_reason = FinishReason("stop", matched=token)
                req.status = RequestStatus.FINISHED
                return j + 1
        return len(result.tokens)


def request(rid: str) -> Request:
    return Request(
        rid=rid,
        prompt_ids=[1, 2, 3],
        sampling=SamplingState(SamplingParams()),
        delivery=Delivery(streaming=True),
    )


def test_each_step_is_delivered_on_its_own_and_the_rest_is_the_callers():
    delivered: list = []
    a, b = request("a"), request("b")
    out = np.full((3, 5), -1, dtype=np.int64)  # row 1 is not streamed
    streams = BurstStreams(
        [(0, a), (2, b)], out, Processor(), lambda r: delivered.append((r.rid, tuple(r.output_ids)))
    )
    assert streams.before_step(0) is False and not delivered  # nothing picked yet
    for step in range(3):
        out[:, step] = [10 + step, 20 + step, 30 + step]
        assert streams.before_step(step + 1) is False
        assert delivered[-2:] == [
            ("a", tuple(range(10, 11 + step))),
            ("b", tuple(range(30, 31 + step))),
        ]
    out[:, 3] = 99  # the burst's last step: no callback follows, the caller appends it
    assert {streams.streamed[a].taken, streams.streamed[b].taken} == {3}
    assert a.output_ids == [10, 11, 12] and len(delivered) == 6


def test_a_request_it_finishes_is_not_delivered_and_a_finished_batch_ends_the_burst():
    delivered: list = []
    req = request("a")
    out = np.full((1, 4), -1, dtype=np.int64)
    streams = BurstStreams(
        [(0, req)], out, Processor(stop=7), lambda r: delivered.append(list(r.output_ids))
    )
    out[0, 0] = 5
    assert streams.before_step(1) is False and delivered == [[5]]
    out[0, 1] = 7  # the stop token: the engine thread delivers the final result
    assert streams.before_step(2) is True, "every streamed row finished: the burst ends"
    assert req.finished and req.output_ids == [5, 7]
    assert streams.streamed[req].added == 2 and delivered == [[5]]


def test_a_batch_with_rows_that_do_not_stream_goes_on():
    req = request("a")
    out = np.full((2, 4), -1, dtype=np.int64)
    streams = BurstStreams([(0, req)], out, Processor(stop=7), lambda r: None)
    out[:, 0] = 7
    assert streams.before_step(1) is False  # row 1 is not streamed: its request waits for the rest
