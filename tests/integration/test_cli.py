"""The `plait` command line, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "plait", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    assert "generate" in out.stdout and "bench" in out.stdout


def test_generate_streams_to_stdout(tiny_llama_dir, tiny_engine):
    out = run("generate", "Hello", "--model", str(tiny_llama_dir), "--max-tokens", "6", "--max-total-tokens", "256")
    assert out.returncode == 0, out.stderr
    expected = tiny_engine.generate("Hello", {"max_new_tokens": 6, "temperature": 0})["text"]
    assert out.stdout == expected + "\n"


def test_generate_with_chat_template(tiny_llama_dir):
    out = run("generate", "Hi", "--chat", "--model", str(tiny_llama_dir), "--max-tokens", "3", "--max-total-tokens", "256")
    assert out.returncode == 0, out.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    out = run("generate", "Hi", "--model", str(tmp_path / "missing"))
    assert out.returncode != 0
    assert "does not exist" in out.stderr
