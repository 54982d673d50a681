"""What one forward pass needs besides token ids and positions; built only by the ModelRunner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.kernels.attention import AttentionMetadata
from plait.runtime.kv_pool import KVPool


@dataclass
class ForwardBatch:
    kv_pool: KVPool
    attn: AttentionMetadata
    logits_indices: torch.Tensor | None  # rows of the flat batch whose logits are needed
