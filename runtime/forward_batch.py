"""What one forward pass needs besides token ids and positions; built only by the ModelRunner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plait.kernels.attention import AttentionMetadata
from plait.runtime.kv_pool import KVPool

if TYPE_CHECKING:
    from plait.runtime.models.native_decode import NativeDecodeStack


@dataclass
class ForwardBatch:
    kv_pool: KVPool
    attn: AttentionMetadata
    logits_indices: torch.Tensor | None  # rows of the flat batch whose logits are needed
    native_stack: NativeDecodeStack | None = None  # the step's layers in one native call (`Execution.layers_for`)
