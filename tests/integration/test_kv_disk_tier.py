"""The local disk tier on a tiny model and a real temporary directory: restarts, eviction round
trips, bad blocks, a process killed while writing, a full disk."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from plait import Engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
BLOCK = 64  # TIER_BLOCK_TOKENS at page_size 4


def prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def engine_kwargs(model_dir: Path, **extra: object) -> dict:
    return dict(
        model_path=str(model_dir),
        page_size=4,
        check_invariants=True,
        max_total_tokens=4096,
        **extra,
    )


def run(engine: Engine, ids: list[int]) -> tuple[list[int], int]:
    out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def wait_written(engine: Engine, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["kv_tiers_pending_write_bytes"] == 0:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"tier writes still pending: {engine.stats()}")


@pytest.fixture(scope="module")
def cold(tiny_llama_dir) -> dict[int, list[int]]:
    """Greedy outputs of an engine without tiers, by prompt seed."""
    with Engine(**engine_kwargs(tiny_llama_dir)) as engine:
        return {seed: run(engine, prompt(seed))[0] for seed in range(4)}


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("??/*.kvb"))


def test_restart_starts_warm_with_the_same_outputs(tiny_llama_dir, tmp_path, cold):
    with Engine(**engine_kwargs(tiny_llama_dir, kv_disk=str(tmp_path))) as engine:
        assert run(engine, prompt(0)) == (cold[0], 0)
        stats = wait_written(engine)
    assert stats["kv_disk_demotions"] == len(block_files(tmp_path)) == 300 // BLOCK
    with Engine(**engine_kwargs(tiny_llama_dir, kv_disk=str(tmp_path))) as engine:
        assert run(engine, prompt(0)) == (cold[0], 300 // BLOCK * BLOCK)
        assert run(engine, prompt(1)) == (cold[1], 0)  # never served: a miss
        stats = engine.stats()
    assert stats["kv_disk_promotions"] == 300 // BLOCK
    assert stats["kv_disk_hits"] == 300 // BLOCK and stats["kv_disk_failures"] == 0
    assert stats["kv_tiers_promoted_tokens"] == 256


def test_evicted_prefix_comes_back_from_disk_identical(tiny_llama_dir, tmp_path, cold):
    # a pool of 128 pages holds one 300-token prompt and its output at a time
    kwargs = engine_kwargs(tiny_llama_dir, kv_disk=str(tmp_path), kv_disk_size="10M")
    kwargs["max_total_tokens"] = 512
    with Engine(**kwargs) as engine:
        for seed in (0, 1, 2):
            assert run(engine, prompt(seed)) == (cold[seed], 0)
            wait_written(engine)
        before = engine.stats()
        output, cached = run(engine, prompt(0))  # evicted by 1 and 2: promoted from disk
        after = engine.stats()
    assert output == cold[0] and cached == 256
    assert after["kv_disk_promotions"] - before["kv_disk_promotions"] == 4
    assert after["kv_disk_demotions"] == 12 and after["kv_disk_failures"] == 0


def test_bad_blocks_are_misses(tiny_llama_dir, tmp_path, cold):
    with Engine(**engine_kwargs(tiny_llama_dir, kv_disk=str(tmp_path))) as engine:
        run(engine, prompt(0))
        run(engine, prompt(1))
        run(engine, prompt(2))
    names = [block_names(tiny_llama_dir, tmp_path, prompt(s)) for s in (0, 1, 2)]
    # prompt 0: its third block corrupted; prompt 1: its first truncated; prompt 2: its second
    # replaced by a block of another prompt (right file name, wrong header)
    flip = path_of(tmp_path, names[0][2])
    data = bytearray(flip.read_bytes())
    data[-100] ^= 0xFF
    flip.write_bytes(bytes(data))
    cut = path_of(tmp_path, names[1][0])
    cut.write_bytes(cut.read_bytes()[:1000])
    path_of(tmp_path, names[2][1]).write_bytes(path_of(tmp_path, names[0][0]).read_bytes())
    with Engine(**engine_kwargs(tiny_llama_dir, kv_disk=str(tmp_path))) as engine:
        assert run(engine, prompt(0)) == (cold[0], 2 * BLOCK)
        assert run(engine, prompt(1)) == (cold[1], 0)
        assert run(engine, prompt(2)) == (cold[2], BLOCK)
        stats = wait_written(engine)
    assert stats["kv_disk_failures_corrupt"] == 2  # the flipped byte and the misnamed block
    assert stats["kv_disk_failures_truncated"] == 1
    assert stats["kv_disk_failures"] == 3
    for name in (names[0][2], names[1][0], names[2][1]):  # dropped, then written anew
        assert (
            path_of(tmp_path, name).stat().st_size == path_of(tmp_path, names[0][0]).stat().st_size
        )


def test_blocks_of_another_kv_dtype_are_foreign(tiny_llama_dir, tmp_path, cold):
    with Engine(**engine_kwargs(tiny_llama_dir, kv_disk=str(tmp_path))) as engine:
        run(engine, prompt(0))
    other = engine_kwargs(tiny_llama_dir, kv_disk=str(tmp_path), kv_cache_dtype="bfloat16")
    with Engine(**other) as engine:
        _, cached = run(engine, prompt(0))  # other names: nothing to find
        assert cached == 0
        stats = wait_written(engine)
    assert stats["kv_disk_lookups"] == 4 and stats["kv_disk_hits"] == 0
    assert len(block_files(tmp_path)) == 8  # both kinds side by side
    # a float32 block under a bfloat16 block's name: refused by its header
    f32 = block_names(tiny_llama_dir, tmp_path, prompt(0))
    bf16 = block_names(tiny_llama_dir, tmp_path, prompt(0), kv_cache_dtype="bfloat16")
    path_of(tmp_path, bf16[0]).write_bytes(path_of(tmp_path, f32[0]).read_bytes())
    with Engine(**other) as engine:
        _, cached = run(engine, prompt(0))
        stats = engine.stats()
    assert cached == 0 and stats["kv_disk_failures_foreign"] == 1


def block_names(model_dir: Path, directory: Path, ids: list[int], **extra: object) -> list[bytes]:
    """The names of the whole blocks of `ids`, as an engine of this configuration stores them."""
    with Engine(**engine_kwargs(model_dir, kv_disk=str(directory), **extra)) as engine:
        return engine.core.tiers.block_names(ids)


def path_of(directory: Path, name: bytes) -> Path:
    return directory / name.hex()[:2] / (name.hex() + ".kvb")


CHILD = textwrap.dedent(
    """
    import json, random, resource, signal, sys
    from plait import Engine

    model_dir, directory, mode = sys.argv[1:4]
    greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}

    def prompt(seed, n=300):
        rng = random.Random(seed)
        return [rng.randrange(100, 40000) for _ in range(n)]

    engine = Engine(model_path=model_dir, page_size=4, max_total_tokens=4096, kv_disk=directory)
    if mode == "full":  # every file past 4 KB fails to grow (EFBIG), as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        outs = [engine.generate(input_ids=prompt(s), sampling_params=greedy) for s in (0, 0)]
        engine.shutdown()
        print(json.dumps({"outputs": [o["output_ids"] for o in outs],
                          "cached": [o["meta_info"]["cached_tokens"] for o in outs],
                          "stats": {k: v for k, v in engine.stats().items() if k.startswith("kv_")}}))
    else:  # writes blocks until killed
        seed = 100
        while True:
            engine.generate(input_ids=prompt(seed, 1000), sampling_params={"max_new_tokens": 1})
            print("served", seed, flush=True)
            seed += 1
    """  # noqa: E501
)


def test_killed_while_writing_restarts_clean(tiny_llama_dir, tmp_path, cold):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tiny_llama_dir), str(tmp_path), "serve"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(3):  # a few prompts served: their blocks are being written
            assert child.stdout.readline().startswith("served")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # what a write cut short leaves: a temporary file of the dead process
    leftover = tmp_path / "tmp" / f"{'ab' * 16}.{child.pid}.7.tmp"
    leftover.write_bytes(b"PLKV" + bytes(100))
    written = len(block_files(tmp_path))
    assert written >= 15
    with Engine(**engine_kwargs(tiny_llama_dir, kv_disk=str(tmp_path))) as engine:
        assert run(engine, prompt(0)) == (cold[0], 0)
        output, cached = run(engine, prompt(100, 1000)[:300])
        assert cached == 256  # served before the kill: found on disk
        stats = wait_written(engine)
        assert stats["kv_disk_failures"] == 0
        deadline = time.monotonic() + 30
        while leftover.exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # the background index removes it
    assert not leftover.exists()
    assert len(block_files(tmp_path)) == written + 4


def test_full_disk_serves_from_memory_with_a_warning(tiny_llama_dir, tmp_path, cold):
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_llama_dir), str(tmp_path), "full"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outputs"] == [cold[0], cold[0]]
    assert result["cached"] == [0, 296]  # the pool still caches it
    stats = result["stats"]
    assert stats["kv_disk_failures_full"] == 1  # then writes stop: no error per block
    assert stats["kv_disk_demotions"] == 0
    assert "is full" in done.stderr and "memory only" in done.stderr
    assert block_files(tmp_path) == []
    assert list((tmp_path / "tmp").iterdir()) == []


def test_sliding_window_models_are_refused_with_a_reason(tmp_path, smollm_tokenizer):
    """A model with sliding-window layers keeps their KV in window pages, which the tiers do not
    hold: the engine refuses the tier at start, naming it, rather than store half a block."""
    from tests.conftest import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "phi3", "phi3", smollm_tokenizer, sliding_window=24)
    with pytest.raises(ValueError, match="kv_disk/kv_redis: .*sliding-window"):
        Engine(**engine_kwargs(path, kv_disk=str(tmp_path / "kv")))
