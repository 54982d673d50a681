"""`plait bench` loads llama.cpp with its extra buffer types off on AMX CPUs: its AMX matmul
segfaulted on the first Q4_1 decode on a Xeon (ggml-org/llama.cpp#20824). A stand-in for
llama-cpp-python's ctypes module checks what the workaround changes, on any machine."""

from __future__ import annotations

import sys
import types

from plait.benchmarks import llama_cpp as bench


def _fake_llama_cpp(monkeypatch) -> types.ModuleType:
    api = types.ModuleType("llama_cpp.llama_cpp")
    api.llama_model_default_params = lambda: types.SimpleNamespace(
        use_extra_bufts=True, n_gpu_layers=0
    )
    package = types.ModuleType("llama_cpp")
    package.llama_cpp = api
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", api)
    return api


def test_amx_cpus_load_llama_cpp_without_extra_buffer_types(monkeypatch):
    api = _fake_llama_cpp(monkeypatch)
    monkeypatch.setattr(bench, "cpu_has_amx", lambda: True)
    assert bench.keep_llama_cpp_off_amx() and bench.keep_llama_cpp_off_amx()  # twice: wrapped once
    params = api.llama_model_default_params()
    assert (
        params.use_extra_bufts is False and params.n_gpu_layers == 0
    )  # the rest as llama.cpp sets it
    assert not hasattr(api.llama_model_default_params.__wrapped__, "plait_no_extra_bufts")


def test_other_cpus_keep_llama_cpp_as_it_is(monkeypatch):
    api = _fake_llama_cpp(monkeypatch)
    monkeypatch.setattr(bench, "cpu_has_amx", lambda: False)
    assert not bench.keep_llama_cpp_off_amx()
    assert api.llama_model_default_params().use_extra_bufts is True


def test_cpu_has_amx_reads_the_flags(monkeypatch, tmp_path):
    import builtins

    real_open, info = builtins.open, tmp_path / "cpuinfo"
    monkeypatch.setattr(
        builtins,
        "open",
        lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k),
    )
    for flags, expected in (
        ("fpu avx512f amx_bf16 amx_tile amx_int8 avx512_vnni", True),
        ("fpu avx2 fma", False),
    ):
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert bench.cpu_has_amx() is expected
