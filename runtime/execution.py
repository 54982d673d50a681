"""How an engine runs its steps, decided once when its runner is built.

`choose_execution` reads what does not change while an engine runs (the device, the weights'
formats, the KV cache's dtype, the CPU's instruction set and which native and Triton kernels
built) and settles the model-wide half of the decision table in docs/architecture.md: whether
all layers can run in one native call, whether whole decode steps can (bursts), which attention
kernels take the CPU rows, which `Sampler` picks the next tokens, whether long prefill chunks
attend in bfloat16. What is left to each step is its shape: the step planner reads the layers for
a batch's token counts (`Execution.layers_for`) into the step's plan (`runtime/step_planner.py`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plait.kernels import attention_cpu, cpu_fused, decode_stack, quant_matmul
from plait.kernels.dispatch import use_triton
from plait.kernels.kv_cache import kv_type_code
from plait.kernels.layer_ops import LayerOps, choose_layer_ops
from plait.kernels.tuning import DEQUANT_GEMM_MIN_ROWS
from plait.runtime.kv_pool import KVPool
from plait.runtime.models import native_decode
from plait.runtime.models.llama import LlamaForCausalLM
from plait.runtime.models.quantized import QuantLinear
from plait.runtime.sampling import Sampler, choose_sampler

if TYPE_CHECKING:
    from plait.runtime.models.native_decode import NativeDecodeStack


class Layers(enum.Enum):
    """How one forward pass runs the decoder layers."""

    LAYERWISE = "layerwise"  # one module after another, each op at its dispatch point
    NATIVE_STACK = "native_stack"  # every layer in one native call (`NativeDecodeStack.run`)


@dataclass(frozen=True)
class Execution:
    device: torch.device
    attention: str  # who attends CPU rows and decodes: "triton", "native" or "torch"
    ops: LayerOps  # the layers' norms, rotation, activation and attention (by `attention`)
    sampling: Sampler  # next tokens from the logits: Triton's, the native one or torch's
    native_stack: NativeDecodeStack | None  # all layers in one native call; None: never
    bursts: bool  # whole decode steps natively (the stack, a native embedding, norm and head)
    bf16_extends: bool  # quantized weights on an AMX CPU: long prefill chunks attend in bfloat16
    sliding_window: int | None
    quantized_matmul: str  # how the quantized linears' products run (`QuantMatmul.describe`)
    layers_note: str = ""  # why the layers never run in one native call, where they do not
    # every step on the native stack, each row's result independent of its batch (`deterministic`)
    batch_invariant: bool = False

    def layers_for(self, num_tokens: int, max_extend: int) -> Layers:
        """All layers in one native call for 1–47 rows that are all attention rows (decodes and
        extends of at most `MAX_ROW_EXTEND` new tokens), and for every step where batch-invariant;
        one by one otherwise."""
        if self.native_stack is not None and (
            self.batch_invariant
            or (
                0 < num_tokens < DEQUANT_GEMM_MIN_ROWS
                and max_extend <= attention_cpu.MAX_ROW_EXTEND
            )
        ):
            return Layers.NATIVE_STACK
        return Layers.LAYERWISE

    def can_burst(self, rows: int) -> bool:
        return self.bursts and 0 < rows < DEQUANT_GEMM_MIN_ROWS

    def describe(self) -> dict[str, str]:
        """The choices, as `plait serve` logs them at start."""
        return {
            "device": str(self.device),
            "layer_ops": self.ops.name,
            "attention": self.attention,
            "sampling": self.sampling.name,
            "layers": "native stack for small steps"
            if self.native_stack is not None
            else f"layerwise ({self.layers_note})"
            if self.layers_note
            else "layerwise",
            "bursts": "native" if self.bursts else "off",
            "prefill_attention": "bfloat16"
            if self.bf16_extends
            else "float32"
            if self.device.type == "cpu"
            else "-",
            "batch_invariant": "on" if self.batch_invariant else "off",
            "native_isa": quant_matmul.native_isa() or "-",
            "quantized_matmul": self.quantized_matmul,
        }


def quantized_matmul_paths(model: torch.nn.Module, device: torch.device) -> str:
    """How the model's quantized linears (every block type kept, `Engine.stats()["weight_types"]`)
    run, as their `QuantMatmul`s chose; for a model without any, as one would choose on `device`."""
    chosen = sorted({m.matmul.describe() for m in model.modules() if isinstance(m, QuantLinear)})
    if not chosen:
        return quant_matmul.describe_paths(quant_matmul.native_on(device))
    return "; ".join(chosen)


def choose_execution(
    model: torch.nn.Module, pool: KVPool, device: torch.device, deterministic: bool = False
) -> Execution:
    """`deterministic`: batch-invariant steps (`Execution.batch_invariant`); a ValueError naming
    it where the model cannot run every step on the native stack."""
    lm = model if isinstance(model, LlamaForCausalLM) else None  # every family's ...ForCausalLM
    embed = (
        getattr(lm.model.embed_tokens, "weight", None) if lm is not None else None
    )  # None: QuantEmbedding
    probe = torch.empty(0, dtype=embed.dtype if embed is not None else torch.float32, device=device)
    attention = choose_attention(probe, pool)
    stack, note = None, ""
    if (
        lm is not None
        and cpu_fused.usable(probe)
        and kv_type_code(pool.dtype) is not None
        and decode_stack.available()
    ):
        blocker = native_decode.unsupported(lm)
        if blocker is None:
            stack = native_decode.NativeDecodeStack(lm, pool, batch_invariant=deterministic)
        else:  # a family the stack cannot run yet: its layers run one by one, said in the stats
            note = f"not on the native stack: {blocker}"
    if deterministic and stack is None:
        raise ValueError(
            "deterministic: batch-invariant steps run on the native CPU decode stack, which this "
            f"engine cannot use ({note or _stack_requirements(device)})"
        )
    bursts = (
        stack is not None
        and native_decode.usable_embedding(lm.model.embed_tokens)
        and native_decode.usable_linear(lm.lm_head)
        and lm.model.norm.weight.dtype == torch.float32
        and decode_stack.burst_available()
    )
    bf16_extends = (
        device.type == "cpu"
        and quant_matmul.bf16_extends_enabled()
        and any(isinstance(m, QuantLinear) for m in model.modules())
    )
    window = lm.args.sliding_window if lm is not None and lm.args.uniform_layers else None
    return Execution(
        device,
        attention,
        choose_layer_ops(device, probe.dtype, attention, pool.head_dim),
        choose_sampler(device, torch.float32),  # the LM head's logits are float32
        stack,
        bursts,
        bf16_extends and not deterministic,
        window,
        quantized_matmul_paths(model, device),
        note,
        batch_invariant=deterministic,
    )


def choose_attention(probe: torch.Tensor, pool: KVPool) -> str:
    """Who attends, for activations like `probe` over `pool`'s caches: Triton on CUDA over a cache
    of the activations' dtype, the native rows over a float32, bfloat16 or int8 CPU cache, torch's
    reference otherwise."""
    k_cache = pool.layer(0)[0]
    if use_triton(probe):
        return "triton" if k_cache.dtype == probe.dtype and pool.scales(0) is None else "torch"
    if attention_cpu.use_native_attention(probe, k_cache):
        return "native"
    return "torch"


def _stack_requirements(device: torch.device) -> str:
    if device.type != "cpu":
        return f"the model runs on {device}"
    if not decode_stack.available():
        return "the native kernels are not built here"
    return "it needs float32 activations and a float32, bfloat16 or int8 KV cache"
