"""The per-model figures of `plait bench latency`: agreement between two teacher-forced runs, and
llama.cpp left out where it is not installed."""

from __future__ import annotations

import sys

import pytest

from plait.benchmarks.model_reference import agreement, llama_cpp_teacher_forced


def test_agreement_counts_top_tokens_and_logprob_deltas():
    ours = ([5, 6, 7, 8], [-1.0, -2.0, -0.5, -3.0])
    theirs = ([5, 6, 9, 8], [-1.01, -2.0, -0.7, -2.9])
    got = agreement(ours, theirs)
    assert got["positions"] == 4 and got["top1_agreement"] == 0.75
    assert got["median_abs_logprob_delta"] == pytest.approx(0.055)
    assert got["max_abs_logprob_delta"] == pytest.approx(0.2)


def test_without_llama_cpp_there_is_no_reference(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # an import of it raises ImportError
    assert llama_cpp_teacher_forced("model.gguf", [1, 2, 3], threads=1) is None
