"""What one forward pass needs besides token ids and positions; built only by the ModelRunner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plait.kernels.attention import AttentionMetadata
from plait.kernels.layer_ops import LayerOps
from plait.runtime.kv_pool import KVPool

if TYPE_CHECKING:
    from plait.runtime.models.native_decode import NativeDecodeStack


@dataclass
class ForwardBatch:
    kv_pool: KVPool
    attn: AttentionMetadata
    logits_indices: torch.Tensor | None  # rows of the flat batch whose logits are needed
    ops: LayerOps  # the layers' norms, rotation, activation and attention (`kernels/layer_ops.py`)
    native_stack: NativeDecodeStack | None = (
        None  # the step's layers in one native call (`Execution.layers_for`)
    )
    # the same layout in the sliding layers' window pages, where the model has both kinds of
    # layers (a model whose layers all slide has its window pages in `attn`)
    attn_window: AttentionMetadata | None = None
    # the LM head's rows as each row alone gets them (`kernels/batch_invariant.py`)
    batch_invariant: bool = False

    def attn_for(self, layer_id: int) -> AttentionMetadata:
        """The layout layer `layer_id` reads and writes its KV through."""
        if self.attn_window is not None and self.kv_pool.window_layers[layer_id]:
            return self.attn_window
        return self.attn
