"""`python -m plait.benchmarks.llama_cpp_server ARGS`: llama-cpp-python's server (`python -m
llama_cpp.server ARGS`) with `keep_llama_cpp_off_amx` applied first, for `plait bench llama-cpp`."""

from __future__ import annotations

from plait.benchmarks.llama_cpp import keep_llama_cpp_off_amx

if __name__ == "__main__":
    import runpy

    keep_llama_cpp_off_amx()
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
