"""`BurstStreamer`: while a burst's native call fills its output buffer step by step, each streamed
request gets each step's token as its own delivery; a request it finishes is left to the engine
thread; `finish` says how many tokens of each row it took."""

from __future__ import annotations

import ctypes
import queue
import time

import torch

from plait.runtime.burst_streams import BurstStreamer
from plait.runtime.protocol import FinishReason, SamplingParams
from plait.runtime.request import Request, RequestStatus

WAIT = 30.0  # seconds a delivery may take on a loaded machine before the test gives up


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
    return Request(rid=rid, prompt_ids=[1, 2, 3], params=SamplingParams(), streaming=True)


def test_each_step_is_delivered_on_its_own_and_the_rest_is_the_callers():
    delivered: queue.Queue = queue.Queue()
    interrupt = ctypes.c_int32(0)
    streamer = BurstStreamer(Processor(), lambda r: delivered.put((r.rid, tuple(r.output_ids))), interrupt)
    a, b = request("a"), request("b")
    out = torch.full((3, 5), -1, dtype=torch.long)  # row 1 is not streamed
    streamer.start([(0, a), (2, b)], out, step_s=0.001)
    for step in range(3):
        out[:, step] = torch.tensor([10 + step, 20 + step, 30 + step])
        got = {delivered.get(timeout=WAIT), delivered.get(timeout=WAIT)}
        assert got == {("a", tuple(range(10, 11 + step))), ("b", tuple(range(30, 31 + step)))}
    streamed = streamer.finish()
    out[:, 3] = 99  # written after `finish`: the caller appends it
    assert {streamed[id(a)].taken, streamed[id(b)].taken} == {3}
    assert a.output_ids == [10, 11, 12] and delivered.empty()
    assert interrupt.value == 0
    streamer.close()


def test_a_request_it_finishes_is_not_delivered_and_a_finished_batch_ends_the_burst():
    delivered: queue.Queue = queue.Queue()
    interrupt = ctypes.c_int32(0)
    streamer = BurstStreamer(Processor(stop=7), lambda r: delivered.put(list(r.output_ids)), interrupt)
    req = request("a")
    out = torch.full((1, 4), -1, dtype=torch.long)
    streamer.start([(0, req)], out, step_s=0.001)
    out[0, 0] = 5
    assert delivered.get(timeout=WAIT) == [5]
    out[0, 1] = 7  # the stop token: the engine thread delivers the final result
    out[0, 2] = 8
    deadline = time.monotonic() + WAIT
    while not interrupt.value and time.monotonic() < deadline:
        time.sleep(0.01)
    assert interrupt.value == 1, "every streamed row finished: the burst is told to end"
    streamed = streamer.finish()
    assert req.finished and req.output_ids == [5, 7]
    assert streamed[id(req)].added == 2 and delivered.empty()
    streamer.close()
