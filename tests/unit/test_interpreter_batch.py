"""`run_batch`: input order, concurrency, the constant prefix prefilled once, failures."""

from __future__ import annotations

import threading

import pytest

from plait.interpreter import MockBackend, render_prefix
from plait.interpreter.run import resolve_num_threads
from plait.lang import assistant, gen, program, system, user

SHOTS = [("great movie", "positive"), ("boring", "negative")]


@program
def classify(s, text):
    s += system("Label the sentiment.")
    for review, label in SHOTS:
        s += user(review) + assistant(label)
    s += user(text)
    s += assistant(gen("label", max_tokens=4))


def label_of(prompt: str, params: dict) -> str:
    return "positive" if "love" in prompt.rsplit("user\n", 1)[-1] else "negative"


def test_results_come_back_in_input_order():
    texts = [f"I love it {i}" if i % 2 else f"meh {i}" for i in range(20)]
    backend = MockBackend(label_of, latency=0.01)
    states = classify.run_batch([{"text": t} for t in texts], backend=backend, num_threads=8)
    assert [s["label"] for s in states] == ["positive" if i % 2 else "negative" for i in range(20)]
    assert [s.messages()[-2]["content"] for s in states] == texts


def test_programs_run_concurrently():
    # every call waits for all 16 to be in flight: run one at a time, the barrier breaks
    barrier = threading.Barrier(16, timeout=30)

    def meet(prompt: str, params: dict) -> str:
        barrier.wait()
        return "x"

    backend = MockBackend(meet)
    states = classify.run_batch(
        [{"text": str(i)} for i in range(16)], backend=backend, num_threads=16
    )
    assert [s["label"] for s in states] == ["x"] * 16
    assert backend.max_concurrency == 16


def test_constant_prefix_is_prefilled_once_before_fanning_out():
    backend = MockBackend("x")
    states = classify.run_batch([{"text": "a"}, {"text": "b"}, {"text": "c"}], backend=backend)
    first, *rest = backend.calls
    prefix = render_prefix(backend, classify)
    assert first.is_prefill_only and first.text == prefix
    assert prefix.startswith("<|im_start|>system\nLabel the sentiment.") and prefix.endswith(
        "negative<|im_end|>\n"
    )
    assert len(rest) == 3 and all(c.text.startswith(prefix) for c in rest)
    # the mock's cache reports the shared prefix as cached for every program (its final "\n"
    # token merges with the next message's first token, as real tokenizers may do)
    prefix_tokens = backend.count_prompt_tokens(prefix)
    assert all(s.get_meta_info("label")["cached_tokens"] >= prefix_tokens - 1 for s in states)


def test_batch_defaults_and_progress_bar(capsys):
    backend = MockBackend("x")
    classify.run_batch(
        [{"text": "a"}, {"text": "b"}], backend=backend, progress_bar=True, temperature=0
    )
    assert all(
        c.sampling_params == {"max_new_tokens": 4, "temperature": 0} for c in backend.generate_calls
    )
    assert "2/2" in capsys.readouterr().err


def test_first_failure_is_raised_and_the_rest_cancelled():
    reasons: list[str] = []

    class FailsOnBad(MockBackend):
        """ "bad" fails once another program's call is in flight; other calls run until aborted."""

        def generate(self, text, sampling_params, **kwargs):
            if "bad" in text:
                assert self.wait_for_active(1)
                raise RuntimeError("bad input")
            out = super().generate(text, sampling_params, **kwargs)
            if sampling_params.get("max_new_tokens") != 0:  # not the prefix warm-up
                reasons.append(out["meta_info"]["finish_reason"]["type"])
            return out

    backend = FailsOnBad("x", latency=60.0)
    batch = [{"text": "bad"}] + [{"text": f"ok {i}"} for i in range(30)]
    with pytest.raises(RuntimeError, match="bad input"):
        classify.run_batch(batch, backend=backend, num_threads=2)
    assert backend.wait_for_idle()
    # the call in flight was aborted, and the programs still queued never called the model
    assert reasons and set(reasons) == {"abort"}
    assert len(backend.generate_calls) < len(batch) - 1


def test_batch_argument_checks():
    assert classify.run_batch([], backend=MockBackend()) == []
    with pytest.raises(TypeError, match="list of argument dicts"):
        classify.run_batch({"text": "a"}, backend=MockBackend())
    with pytest.raises(TypeError, match="program classify"):
        classify.run_batch([{"txt": "a"}], backend=MockBackend())
    assert resolve_num_threads("auto", 3) == 3
    assert resolve_num_threads(4, 100) == 4
    with pytest.raises(ValueError, match="num_threads"):
        resolve_num_threads(0, 5)
