"""Tensor parallelism on gloo over loopback: TP=2 gives TP=1's logits (float32 tolerance) and
the same greedy output, for an even head split and an uneven one (SmolLM2's 3 KV heads), and for
the families whose heads shard alike (Qwen3 with its q/k norms, Phi-3 from its fused weights,
Gemma 3 with its sliding layers' window pages)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import write_tiny_checkpoint

PROMPTS = [
    "The quick brown fox jumps over the lazy dog and then it",
    "1, 2, 3, 4,",
    "<|im_start|>user\nHi<|im_end|>\n",
]
PARAMS = {"max_new_tokens": 24, "temperature": 0}


def _run(engine) -> list[dict]:
    return engine.generate(PROMPTS, PARAMS, return_logprob=True, logprob_start_len=0)


def _logprobs(out: dict) -> list[float]:
    meta = out["meta_info"]
    return [lp for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]


def _assert_same(reference: list[dict], parallel: list[dict]) -> None:
    for ref, par in zip(reference, parallel):
        assert par["output_ids"] == ref["output_ids"]
        assert par["text"] == ref["text"]
        assert _logprobs(par) == pytest.approx(_logprobs(ref), abs=1e-4)


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory, smollm_tokenizer):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-gqa3"),
        "llama",
        smollm_tokenizer,
        seed=1,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
    )


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, smollm_tokenizer):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", smollm_tokenizer, seed=2, head_dim=16
    )


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, smollm_tokenizer):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-phi3"), "phi3", smollm_tokenizer, seed=2
    )


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, smollm_tokenizer):
    """Sliding and global layers, a window the prompts and outputs outgrow: the window pages'
    layout goes to every rank beside the pool's."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-gemma3"),
        "gemma3",
        smollm_tokenizer,
        seed=2,
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    )


@pytest.mark.parametrize(
    "checkpoint", ["tiny_llama_dir", "uneven_dir", "qwen3_dir", "phi3_dir", "gemma3_dir"]
)
def test_tp2_matches_tp1(checkpoint, request):
    from plait import Engine

    path = str(request.getfixturevalue(checkpoint))
    kwargs = {"max_total_tokens": 2048, "page_size": 4, "check_invariants": True}
    with Engine(model_path=path, **kwargs) as single:
        reference = _run(single)
    with Engine(model_path=path, tp_size=2, **kwargs) as parallel:
        assert parallel.args.num_kv_heads in (1, 2) and parallel.core.tp is not None
        _assert_same(reference, _run(parallel))
        again = parallel.generate(PROMPTS[0], PARAMS)  # the prefix cache, shared across ranks
        assert again["meta_info"]["cached_tokens"] > 0
        assert again["output_ids"] == reference[0]["output_ids"]


def test_tp_size_is_validated(tiny_llama_dir):
    from plait import Engine

    with pytest.raises(ValueError, match="tp_size: 3 ranks exceed the model's 2 KV heads"):
        Engine(model_path=str(tiny_llama_dir), tp_size=3, max_total_tokens=256)
    with pytest.raises(ValueError, match="tp_size"):
        Engine(model_path=str(tiny_llama_dir), tp_size=2, quantization="int8")


def test_partition_covers_every_item_once():
    from plait.runtime.models.tensor_parallel import partition

    for n in (1, 3, 9, 1536):
        for parts in range(1, min(n, 5) + 1):
            spans = [partition(n, parts, r) for r in range(parts)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert max(e - s for s, e in spans) - min(e - s for s, e in spans) <= 1


def _served_text(url: str) -> str:
    import httpx

    body = {"text": PROMPTS[1], "sampling_params": PARAMS}
    return httpx.post(url + "/generate", json=body, timeout=60).json()["text"]


@pytest.mark.slow
def test_plait_serve_tp_and_torchrun(tiny_llama_dir, tiny_engine, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from plait.server.launch import ServerProcess, free_port, wait_for_health

    expected = tiny_engine.generate(PROMPTS[1], PARAMS)["text"]
    flags = ["--model", str(tiny_llama_dir), "--max-total-tokens", "2048", "--log-level", "warning"]
    with ServerProcess(["--tp", "2", *flags], timeout=120) as server:
        assert _served_text(server.url) == expected
        ranks = _children(server.process.pid)
        assert ranks, "rank 1 runs as a child process"
    assert (
        server.process.returncode == 0
    )  # a clean exit through engine.shutdown(), not death by signal
    # SIGTERM (what `stop` sends) shuts the engine down, and with it the other ranks
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, "rank processes outlived plait serve"
        time.sleep(0.1)
    port = free_port()
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "plait.server.cli",
        "--tp",
        "2",
        "--port",
        str(port),
        *flags,
    ]
    log = tmp_path / "torchrun.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        try:
            wait_for_health(f"http://127.0.0.1:{port}", 120, proc)
        except RuntimeError as e:
            raise AssertionError(f"{e}; its log ends:\n{log.read_text()[-4000:]}") from None
        assert _served_text(f"http://127.0.0.1:{port}") == expected
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_tp2_with_an_int8_kv_cache(tiny_llama_dir):
    """Every rank stores its heads' KV as int8, as TP=1 does."""
    from plait import Engine

    kwargs = {"max_total_tokens": 2048, "page_size": 4, "kv_cache_dtype": "int8"}
    with Engine(model_path=str(tiny_llama_dir), **kwargs) as single:
        reference = _run(single)
    with Engine(model_path=str(tiny_llama_dir), tp_size=2, **kwargs) as parallel:
        _assert_same(reference, _run(parallel))
