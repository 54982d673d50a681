"""The one module that reads plait's environment variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait import environment
from plait.environment import Environment


def test_defaults_when_nothing_is_set() -> None:
    env = Environment.from_mapping({})
    assert env == Environment()
    assert env.native_march == "native" and env.bf16_gemm is None and env.cxx is None
    assert env.cache_dir == Path.home() / ".cache" / "plait"


def test_values_are_parsed() -> None:
    env = Environment.from_mapping(
        {
            "PLAIT_DISABLE_NATIVE": "Yes",
            "PLAIT_NATIVE_MARCH": "haswell",
            "PLAIT_CACHE_DIR": "/x/y",
            "PLAIT_BF16_GEMM": "0",
            "PLAIT_DISABLE_TRITON": "on",
            "CXX": "clang++",
        }
    )
    assert env == Environment(True, "haswell", Path("/x/y"), False, True, "clang++")
    assert Environment.from_mapping({"PLAIT_BF16_GEMM": "auto"}).bf16_gemm is None
    assert Environment.from_mapping({"PLAIT_BF16_GEMM": "true"}).bf16_gemm is True


@pytest.mark.parametrize(
    "name,value",
    [
        ("PLAIT_DISABLE_NATIVE", "2"),
        ("PLAIT_BF16_GEMM", "maybe"),
        ("PLAIT_NATIVE_MARCH", "x86-64 -O0"),
    ],
)
def test_a_bad_value_names_its_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        Environment.from_mapping({name: value})


def test_current_is_read_once_and_reload_reads_again(monkeypatch) -> None:
    before = environment.current()
    try:
        monkeypatch.setenv("PLAIT_DISABLE_TRITON", "1" if not before.disable_triton else "0")
        assert environment.current() is before
        assert environment.reload().disable_triton is not before.disable_triton
        assert environment.current().disable_triton is not before.disable_triton
    finally:
        monkeypatch.undo()
        environment.reload()
