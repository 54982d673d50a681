"""`plait bench overhead`: how much of a single-stream decode step is not the model's arithmetic.

Two measures, both decoding 128 tokens on one stream:

- *Python and dispatch*: the model itself with its native layer stack and matmul kernels replaced
  by no-ops, and bursts of continuous decode steps by an instant fixed token
  (`kernels_stubbed`; the tokens are garbage, only the time counts). What remains is Python,
  scheduling, sampling, detokenization and the few torch ops around the kernels.
- A *skinny twin*: the same layer count, vocabulary and tokenizer, hidden size 64 and random
  weights, so its matmuls and attention cost little while every call, kernel launch and thread
  team stays. Its step over the model's is an upper bound: its LM head still has a row per
  token of the vocabulary (49,152 rows of 64 weights for SmolLM2), whose per-row work is real.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from plait.benchmarks.common import check_decoded, print_table, write_json


def write_skinny_twin(engine: Any, path: Path) -> Path:
    """A Hugging Face Llama checkpoint shaped like `engine`'s model but 64 wide (tied head)."""
    from safetensors.torch import save_file

    args, hidden, inter, heads, kv_heads, head_dim = engine.args, 64, 64, 2, 1, 32
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.08

    tensors = {
        "model.embed_tokens.weight": rand(args.vocab_size, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": args.vocab_size,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": args.max_position_embeddings,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    tok = engine.tokenizer
    tok.backend.save(str(path / "tokenizer.json"))
    eos = tok.convert_ids_to_tokens([tok.eos_token_id])[0]
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": eos, "add_bos_token": False})
    )
    return path


@contextmanager
def kernels_stubbed() -> Iterator[None]:
    """The native decoder-layer stack and matmul kernels (layers and LM head) do nothing while
    inside, and a burst of continuous decode steps returns a fixed token at once: a step's
    remaining time is its Python and dispatch. Swap only between requests."""
    from plait.kernels import decode_stack, quant_matmul

    saved = decode_stack._kernel, quant_matmul._kernels, decode_stack.run_burst
    kernels = quant_matmul._kernels()

    def nothing(*args: Any) -> int:
        return -1  # the decode stack's "every slot inside the pool"; the matmul's result is unused

    def no_burst(
        layers, num_layers, shape, burst, ids: torch.Tensor, steps: int, *rest: Any
    ) -> torch.Tensor:
        return torch.full((ids.shape[0], steps), 100, dtype=torch.long)  # any token but a stop

    if decode_stack._kernel() is not None:
        decode_stack._kernel = lambda: nothing
    if kernels is not None:
        quant_matmul._kernels = lambda: (nothing, *kernels[1:])
    decode_stack.run_burst = no_burst
    try:
        yield
    finally:
        decode_stack._kernel, quant_matmul._kernels, decode_stack.run_burst = saved


def decode_step_ms(engine: Any, decode_len: int, repeats: int) -> float:
    ids = list(range(1000, 1016))
    params = {"max_new_tokens": decode_len, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4})
    best = float("inf")
    for _ in range(repeats):
        first = last = None
        for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
            last = chunk
            if first is None:
                first = time.perf_counter()
        best = min(best, (time.perf_counter() - first) / (decode_len - 1))
        check_decoded(last, decode_len)
    return best * 1e3


def run_overhead_bench(args: argparse.Namespace) -> int:
    from plait.benchmarks.latency_runs import FORMATS, _format_kwargs
    from plait.runtime.engine import Engine, off_main_thread

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in FORMATS:
            raise SystemExit(f"--formats: unknown format {f!r} (choose from {', '.join(FORMATS)})")
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        twin_path = None
        for fmt in formats:
            kwargs = {"max_total_tokens": 2048, **_format_kwargs(fmt)}
            with Engine(model_path=args.model_path, **kwargs) as engine:
                if (
                    twin_path is None
                ):  # NOTE: torch ops on the main thread would leave an OpenMP team
                    # behind that throttles the engines' (see `off_main_thread`) and would
                    # slow every step this benchmark times
                    twin_path = off_main_thread(write_skinny_twin, engine, Path(tmp) / "twin")
                full = decode_step_ms(engine, args.decode_len, args.repeats)
                with kernels_stubbed():
                    python = decode_step_ms(engine, args.decode_len, args.repeats)
                layers = engine.args.num_layers
            with Engine(model_path=str(twin_path), **kwargs) as twin:
                skinny = decode_step_ms(twin, args.decode_len, args.repeats)
            results[fmt] = {
                "step_ms": full,
                "python_step_ms": python,
                "python_share": python / full,
                "twin_step_ms": skinny,
                "overhead_share": skinny / full,
            }
            rows.append(
                [
                    fmt,
                    layers,
                    full,
                    1e3 / full,
                    python,
                    f"{python / full:.0%}",
                    skinny,
                    f"{skinny / full:.0%}",
                ]
            )
    print(
        f"\nsingle-stream decode, {args.decode_len} tokens, best of {args.repeats}, "
        f"{torch.get_num_threads()} threads"
    )
    print_table(
        [
            "format",
            "layers",
            "step ms",
            "tok/s",
            "kernels stubbed ms",
            "python share",
            "skinny twin step ms",
            "overhead share (twin)",
        ],
        rows,
    )
    write_json(
        args.output, {"benchmark": "overhead", "decode_len": args.decode_len, "results": results}
    )
    return 0


def add_overhead_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--formats", default="float32,int4", help="comma-separated: float32, bfloat16, int8, int4"
    )
    parser.add_argument(
        "--decode-len", dest="decode_len", type=int, default=128, help="tokens decoded"
    )
    parser.add_argument("--repeats", type=int, default=3, help="measurements per figure")
    parser.add_argument(
        "--output", default="bench-results/overhead.json", help="JSON file of the results"
    )
