"""The salt of the KV hash chain: everything besides the token ids that decides a page's KV.

Two engines whose salts are equal compute the same keys and values for the same tokens, so they
may share pages through any tier; anything that changes KV changes the salt: the checkpoint's
weights, the model's hyperparameters (rope base and scaling, windows, norms), the compute dtype,
the weight quantization, the KV dtype, the page size and the kind of device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

# bumped whenever the block layout or the hash chain changes: older blocks then simply miss
KV_FORMAT_VERSION = 1
_SAMPLES = 64  # evenly spaced chunks read from each weight file besides its head and tail
_SAMPLE_BYTES = 16 * 1024
_END_BYTES = 1024 * 1024


def weights_fingerprint(path: str) -> bytes:
    """A digest of a checkpoint's weight files (a .gguf file, or a folder's config and
    safetensors): their sizes, first and last MiB and evenly spaced samples. Reads ~3 MiB per
    file however large it is; a renamed or moved copy has the same fingerprint."""
    if os.path.isdir(path):
        names = sorted(
            n for n in os.listdir(path) if n.endswith(".safetensors") or n == "config.json"
        )
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        size = os.path.getsize(file)
        digest.update(size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            if size <= 2 * _END_BYTES + _SAMPLES * _SAMPLE_BYTES:
                digest.update(f.read())
                continue
            digest.update(f.read(_END_BYTES))
            span = size - 2 * _END_BYTES - _SAMPLE_BYTES
            for i in range(_SAMPLES):
                f.seek(_END_BYTES + span * i // (_SAMPLES - 1))
                digest.update(f.read(_SAMPLE_BYTES))
            f.seek(size - _END_BYTES)
            digest.update(f.read(_END_BYTES))
    return digest.digest()


def kv_salt(
    weights: bytes,
    args: Any,
    dtype: str,
    quantization: str | None,
    kv_dtype: str,
    page_size: int,
    device_type: str,
) -> bytes:
    """The salt `RadixCache(salt=...)` chains page names from (`args`: the model's ModelArgs)."""
    fields = {
        "format": KV_FORMAT_VERSION,
        "weights": weights.hex(),
        "args": repr(sorted(dataclasses.asdict(args).items())),
        "dtype": dtype,
        "quantization": quantization,
        "kv_dtype": kv_dtype,
        "page_size": page_size,
        "device": device_type,
    }
    return repr(sorted(fields.items())).encode()
