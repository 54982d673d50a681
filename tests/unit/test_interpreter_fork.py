"""Forks: branches continue from the same text, run concurrently, nest, and join back."""

from __future__ import annotations

import threading

import pytest

from plait.interpreter import MockBackend
from plait.lang import assistant, fork, gen, join, program, user


def echo_branch(prompt: str, params: dict) -> str:
    return f"idea from {prompt.rsplit('branch ', 1)[-1][:1]}"


@program
def brainstorm(s):
    s += user("Give ideas.")
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"branch {i}: " + gen("idea", max_tokens=8)
    forks.join()
    s += assistant("Done.")


def test_branches_share_the_prefix_and_gather_variables():
    backend = MockBackend(echo_branch)
    state = brainstorm.run(backend=backend)
    assert state["idea"] == ["idea from 0", "idea from 1", "idea from 2"]
    assert [m["role"] for m in state.messages()] == ["user", "assistant"]
    prefix = "<|im_start|>user\nGive ideas.<|im_end|>\n"
    assert state.text() == prefix + "<|im_start|>assistant\nDone.<|im_end|>\n"
    warm, *branches = backend.calls
    assert warm.text == prefix and warm.is_prefill_only  # the fork warms the shared prefix
    assert sorted(c.text for c in branches) == [prefix + f"branch {i}: " for i in range(3)]
    # the mock's cache saw the prefix first, so every branch reports it cached
    metas = state.get_meta_info("idea")
    assert all(m["cached_tokens"] >= 9 for m in metas)


def test_branches_run_concurrently():
    # each branch's call waits for the other two: run one after another, the barrier breaks
    barrier = threading.Barrier(3, timeout=30)

    def meet(prompt: str, params: dict) -> str:
        barrier.wait()
        return "x"

    backend = MockBackend(meet)
    assert brainstorm.run(backend=backend)["idea"] == ["x", "x", "x"]
    assert backend.max_concurrency == 3


def test_branch_state_is_independent():
    @program
    def p(s):
        s += "root "
        a, b = s.fork(2)
        a += "left " + gen("x")
        b += "right " + gen("x")
        assert a.text() == "root left L" and b.text() == "root right R"
        assert a["x"] == "L" and b["x"] == "R"
        s += "end"

    state = p.run(backend=MockBackend(lambda prompt, _: "L" if "left" in prompt else "R"))
    assert state.text() == "root end"
    assert "x" not in state  # not joined


def test_nested_forks_and_concat_join():
    @program
    def tree(s):
        s += "Q."
        outer = s.fork(2)
        for i, branch in enumerate(outer):
            branch += f" [{i}]" + gen("step", max_tokens=4)
            inner = branch.fork(2)
            for j, leaf in enumerate(inner):
                leaf += f" ({i}.{j})" + gen("leaf", max_tokens=4)
            inner.join()
            inner.join("concat")
        outer.join("concat")

    backend = MockBackend(lambda prompt, _: "s" if prompt.endswith("]") else "l")
    state = tree.run(backend=backend)
    assert state.text() == "Q. [0]s (0.0)l (0.1)l [1]s (1.0)l (1.1)l"
    generated = [c.text for c in backend.generate_calls]
    assert "Q. [1]s (1.1)" in generated and len(generated) == 6


def test_fork_helpers_and_group_append():
    @program
    def p(s):
        s += "x"
        forks = fork(s, 2)
        forks += [" a", " b"]
        forks += gen("v")
        forks[0] += "!"
        join(forks)
        with pytest.raises(ValueError, match="2 branches"):
            forks += ["only one"]

    state = p.run(backend=MockBackend(lambda prompt, _: prompt[-1]))
    assert state["v"] == ["a", "b"]


def test_join_rejects_unknown_mode_and_fork_needs_positive_n():
    @program
    def p(s, n, mode):
        forks = s.fork(n)
        forks.join(mode)

    with pytest.raises(ValueError, match="mode"):
        p.run(n=2, mode="zip", backend=MockBackend())
    with pytest.raises(ValueError, match="positive integer"):
        p.run(n=0, mode="concat", backend=MockBackend())


def test_fork_inside_an_open_message():
    @program
    def p(s):
        s += user("Pick.")
        with s.assistant():
            s += "I pick "
            forks = s.fork(2)
            forks += gen("x")
            forks.join()
            s += "both"

    state = p.run(backend=MockBackend("one"))
    assert state.messages()[-1] == {"role": "assistant", "content": "I pick both"}
