"""Errors surface to the caller with the program's frame; running model calls are aborted."""

from __future__ import annotations

import threading
import time
import traceback

import pytest

from plait.interpreter import GenerationError, MockBackend, ProgramCancelled
from plait.lang import gen, program


class Boom(Exception):
    pass


class FinishReasons(MockBackend):
    """Records how each generating call finished."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reasons: list[str] = []
        self._recorded = threading.Condition()

    def generate(self, text, sampling_params, **kwargs):
        out = super().generate(text, sampling_params, **kwargs)
        outs = out if isinstance(out, list) else [out]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        if any(p.get("max_new_tokens") != 0 for p in params):  # not a prefix warm-up
            with self._recorded:
                self.reasons += [o["meta_info"]["finish_reason"]["type"] for o in outs]
                self._recorded.notify_all()
        return out

    def wait_for_reasons(self, n: int, timeout: float = 30.0) -> list[str]:
        """The finish reasons once `n` calls have finished (a hang guard, not a measurement)."""
        with self._recorded:
            self._recorded.wait_for(lambda: len(self.reasons) >= n, timeout)
            return list(self.reasons)


def test_user_exception_shows_the_program_frame_and_aborts_running_calls():
    backend = FinishReasons("slow", latency=60.0)  # only an abort ends it early

    @program
    def failing(s):
        s += "start " + gen("x")
        assert backend.wait_for_active(1)  # the gen is now in flight on the worker thread
        raise Boom("program bug")

    with pytest.raises(Boom) as info:
        failing.run(backend=backend)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "failing" in frames
    assert len(backend.aborted) == 1 and backend.aborted[0] == backend.calls[0].rid
    assert backend.wait_for_reasons(1) == ["abort"]


def test_backend_error_names_the_program_line():
    def broken(prompt: str, params: dict) -> str:
        raise ConnectionError("backend down")

    @program
    def calls_model(s):
        s += "Q: "
        s += gen("answer")  # the line the note points at

    with pytest.raises(ConnectionError, match="backend down") as info:
        calls_model.run(backend=MockBackend(broken))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    line = calls_model.func.__code__.co_firstlineno + 3
    assert f"test_interpreter_errors.py:{line} in calls_model" in notes
    assert "in program 'calls_model'" in notes


def test_a_failed_node_stops_the_program_at_its_next_step():
    reached = []

    def broken(prompt: str, params: dict) -> str:
        raise ValueError("bad output")

    @program
    def loop(s):
        for i in range(100):
            s += gen(f"x{i}")  # runs on the worker thread; the body goes on
            deadline = time.monotonic() + 30  # a hang guard, not a measurement
            while s.error is None and time.monotonic() < deadline:
                time.sleep(0.001)
            reached.append(i)

    with pytest.raises(ValueError, match="bad output") as info:
        loop.run(backend=MockBackend(broken))
    assert reached == [0]  # the step after the failed gen raised
    assert "loop" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]


def test_aborted_request_is_a_generation_error():
    class AbortingBackend(MockBackend):
        def generate(self, text, sampling_params, **kwargs):
            out = super().generate(text, sampling_params, **kwargs)
            out["meta_info"]["finish_reason"] = {"type": "abort", "message": "out of memory"}
            return out

    @program
    def p(s):
        s += gen("x")

    with pytest.raises(GenerationError, match="gen 'x'.*out of memory"):
        p.run(backend=AbortingBackend())


def test_fork_branches_are_aborted_when_the_program_fails():
    backend = FinishReasons("slow", latency=60.0)

    @program
    def p(s):
        s += "root"
        forks = s.fork(3)
        forks += gen("x")
        assert backend.wait_for_active(3)  # all three branches' calls are in flight
        raise Boom("stop")

    with pytest.raises(Boom):
        p.run(backend=backend)
    assert len(backend.aborted) == 3
    assert backend.wait_for_reasons(3) == ["abort"] * 3


def test_a_cancelled_state_refuses_more_work():
    state_box = []

    @program
    def p(s):
        state_box.append(s)
        raise Boom("x")

    with pytest.raises(Boom):
        p.run(backend=MockBackend())
    (state,) = state_box
    with pytest.raises(Boom):
        state += "more"
    assert isinstance(state.error, Boom)


def test_error_from_a_branch_surfaces_on_join():
    def by_branch(prompt: str, params: dict) -> str:
        if prompt.endswith("bad"):
            raise RuntimeError("branch failed")
        return "ok"

    @program
    def p(s):
        forks = s.fork(2)
        forks += ["good", "bad"]
        forks += gen("x")
        forks.join()

    with pytest.raises(RuntimeError, match="branch failed"):
        p.run(backend=MockBackend(by_branch))


def test_program_cancelled_is_named():
    from plait.interpreter.executor import StreamExecutor
    from plait.lang import SamplingSpec

    backend = MockBackend()
    ex = StreamExecutor(backend, backend.chat_template(), SamplingSpec())
    ex.cancel()
    with pytest.raises(ProgramCancelled, match="cancelled"):
        ex.sync()
    assert threading.active_count() >= 1
