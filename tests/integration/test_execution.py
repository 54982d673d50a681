"""The engine's execution choices (`runtime/execution.py`): made once from the model and the
machine, reported in the stats, and each step's plan (`StepPlanner`) taken from its shape."""

from __future__ import annotations

import pytest

from plait import Engine
from plait.kernels import decode_stack
from plait.runtime.execution import Layers

native = pytest.mark.skipif(
    not decode_stack.burst_available(), reason="native CPU kernels did not build"
)


@native
def test_a_float32_cpu_model_gets_the_native_stack_and_bursts(tiny_llama_dir) -> None:
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=1024) as engine:
        execution = engine.core.runner.execution
        assert (
            execution.native_stack is not None
            and execution.bursts
            and execution.attention == "native"
        )
        assert execution.layers_for(1, 0) is Layers.NATIVE_STACK
        assert execution.layers_for(47, 16) is Layers.NATIVE_STACK
        assert execution.layers_for(48, 0) is Layers.LAYERWISE  # a matmul's GEMM takes over
        assert execution.layers_for(20, 17) is Layers.LAYERWISE  # a prefill chunk
        assert (
            execution.can_burst(47) and not execution.can_burst(48) and not execution.can_burst(0)
        )
        stats = engine.stats()
        assert stats["execution_layers"] == "native stack for small steps"
        assert stats["execution_bursts"] == "native" and stats["execution_attention"] == "native"


def test_a_bfloat16_model_runs_layer_by_layer_and_never_bursts(tiny_llama_dir) -> None:
    with Engine(model_path=str(tiny_llama_dir), dtype="bfloat16", max_total_tokens=512) as engine:
        execution = engine.core.runner.execution
        assert execution.native_stack is None and not execution.bursts
        assert execution.layers_for(1, 0) is Layers.LAYERWISE
        assert engine.stats()["execution_layers"] == "layerwise"


@native
def test_each_step_is_planned_from_its_shape(tiny_llama_dir) -> None:
    with Engine(
        model_path=str(tiny_llama_dir), max_total_tokens=1024, num_continuous_decode_steps=1
    ) as engine:
        runner = engine.core.runner
        real_execute, real_prepare, plans = runner.execute, runner.prepare, []

        def execute(plan, *args):
            plans.append([plan.num_tokens, plan.layers])
            return real_execute(plan, *args)

        def prepare(batch, layers=None):  # what the runner built from the plan
            prepared = real_prepare(batch, layers)
            assert prepared.layers is plans[-1][1]
            plans[-1].append(prepared.forward_batch.native_stack)
            return prepared

        runner.execute, runner.prepare = execute, prepare
        engine.generate(
            input_ids=list(range(10, 50)), sampling_params={"max_new_tokens": 3, "ignore_eos": True}
        )
    assert (
        tuple(plans[0][:2]) == (40, Layers.LAYERWISE) and plans[0][2] is None
    )  # the 40-token prefill
    assert [tuple(p[:2]) for p in plans[1:]] == [(1, Layers.NATIVE_STACK)] * 2
    assert all(p[2] is runner.execution.native_stack for p in plans[1:])


@native
def test_layers_run_the_operations_chosen_at_start(tiny_llama_dir, monkeypatch) -> None:
    """The layers call the operations object the engine chose once; nothing asks the device, the
    dtype or the environment again while a step runs (a long prompt: layer by layer)."""
    from plait.kernels import attention_cpu, cpu_fused, layer_ops

    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=1024) as engine:
        ops = engine.core.runner.execution.ops
        assert type(ops) is layer_ops.NativeCpuOps and ops.attention.name == "native"
        assert engine.stats()["execution_layer_ops"] == "native"

        def asked(*args):
            raise AssertionError("a layer probed for its kernels during a step")

        for module, name in (
            (cpu_fused, "usable"),
            (layer_ops, "use_triton"),
            (attention_cpu, "use_native_attention"),
        ):
            monkeypatch.setattr(module, name, asked)
        out = engine.generate(
            input_ids=list(range(10, 90)), sampling_params={"max_new_tokens": 3, "temperature": 0}
        )
        assert len(out["output_ids"]) == 3
        assert engine.core.runner.execution.layers_for(80, 80) is Layers.LAYERWISE  # the prefill
