"""An engine step's four stages (`EngineCore.step`): the scheduler makes the batch, the planner
plans it, the runner executes the plan, the applier takes the results (`apply`), and once the
scheduler has recorded the step (`after_step`) jumps and delivers (`settle`). A spy on the
scheduler shows that no stage calls into it: the step itself calls `schedule` first and
`after_step` between the applier's two halves."""

from __future__ import annotations

import pytest

from plait import Engine
from plait.runtime.scheduler import Scheduler

STAGES = ("plan", "execute", "apply", "settle")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = Engine(
        model_path=str(tiny_llama_dir),
        max_total_tokens=4096,
        page_size=4,
        check_invariants=True,
        speculative_algorithm="ngram",
        num_draft_tokens=4,
        speculation="always",
    )
    yield engine
    engine.shutdown()


def _spy(engine, monkeypatch) -> list[tuple[str, str]]:
    """Events as (where, what): ("step", stage) when a stage starts and ("end", stage) when it
    returns, ("scheduler", method) for each call into the scheduler from outside it."""
    core, events, inside = engine.core, [], [0]
    for name, fn in vars(Scheduler).items():
        if callable(fn) and not name.startswith("__"):
            bound = getattr(core.scheduler, name)

            def call(*args, _name=name, _bound=bound, **kwargs):
                if not inside[0]:
                    events.append(("scheduler", _name))
                inside[0] += 1
                try:
                    return _bound(*args, **kwargs)
                finally:
                    inside[0] -= 1

            monkeypatch.setattr(core.scheduler, name, call)
    stages = ((core.planner, "plan"), (core.runner, "execute"))
    for owner, name in (*stages, (core.applier, "apply"), (core.applier, "settle")):
        real = getattr(owner, name)

        def stage(*args, _name=name, _real=real, **kwargs):
            events.append(("step", _name))
            try:
                return _real(*args, **kwargs)
            finally:
                events.append(("end", _name))

        monkeypatch.setattr(owner, name, stage)
    real_step = core.step

    def step():
        events.append(("step", "begin"))
        real_step()
        events.append(("step", "end"))

    monkeypatch.setattr(core, "step", step)
    return events


def _steps(events: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The events of each step (`EngineCore.step`) whose batch was run."""
    steps: list[list[tuple[str, str]]] = []
    current: list[tuple[str, str]] | None = None
    for event in list(events):
        if event == ("step", "begin"):
            current = []
        elif event == ("step", "end") and current is not None:
            steps.append(current)
            current = None
        elif current is not None:
            current.append(event)
    return [step for step in steps if ("step", "plan") in step]


def test_stages_run_in_order_and_none_reenters_the_scheduler(engine, monkeypatch) -> None:
    events = _spy(engine, monkeypatch)
    repeat = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    json_schema = (
        '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
    )
    outs = engine.generate(
        ["a b c a b c a b c a b", "Name:"],
        [repeat, {"max_new_tokens": 16, "temperature": 0, "json_schema": json_schema}],
    )
    assert all(o["meta_info"]["finish_reason"]["type"] in ("stop", "length") for o in outs)
    steps = _steps(events)
    assert steps, events
    for step in steps:
        stages = [what for where, what in step if where == "step"]
        assert stages == list(STAGES), step
        assert step[0] == ("scheduler", "schedule"), step
        after = step[1:]
        calls = [what for where, what in after if where == "scheduler"]
        # the step records itself once (and checks the accounting: check_invariants)
        assert calls in (["after_step"], ["after_step", "check"]), step
        at = after.index(("scheduler", "after_step"))
        assert after.index(("end", "apply")) < at < after.index(("step", "settle")), step
        inside = None  # no stage calls into the scheduler while it runs
        for where, what in after:
            if where == "step":
                inside = what
            elif where == "end":
                inside = None
            else:
                assert inside is None, (inside, what, step)
    assert engine.stats()["spec_verify_steps"] > 0  # drafts were planned and verified
    assert outs[1]["meta_info"]["jump_forward_tokens"] > 0  # a jump: its tail recomputed
