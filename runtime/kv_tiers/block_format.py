"""How a KV block is stored in a tier: a fixed header, then the payload.

The header names the block, the salt digest of the engine that wrote it and the payload's layout,
and carries a CRC-32 of the payload, so a reader can refuse what is not exactly the block it asked
for: a truncated or corrupted payload, or a block written by another model, KV dtype or page size.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"PLKV"
VERSION = 1
# magic, version, salt digest (16), block name (16), layout digest (16), payload bytes, crc32
_HEADER = struct.Struct("<4sH16s16s16sQI")
HEADER_BYTES = _HEADER.size


class BlockError(Exception):
    """A stored block that cannot be used; `kind` is truncated, corrupt or foreign."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class BlockLayout:
    """The payload's shape: per layer, K then V of `block_pages` pages ([page_size, num_kv_heads,
    head_dim] each, in `dtype`), then the int8 pool's K and V scales ([page_size, num_kv_heads]
    float32) when `scales`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    itemsize: int
    page_size: int
    block_pages: int
    scales: bool

    @property
    def block_tokens(self) -> int:
        return self.page_size * self.block_pages

    @property
    def page_bytes(self) -> int:
        """One page of one layer's K (or V), scales included."""
        per_token = self.num_kv_heads * (self.head_dim * self.itemsize + (4 if self.scales else 0))
        return self.page_size * per_token

    @property
    def payload_bytes(self) -> int:
        return 2 * self.num_layers * self.block_pages * self.page_bytes

    def digest(self) -> bytes:
        return hashlib.blake2b(repr(self).encode(), digest_size=16).digest()


class BlockCodec:
    """Writes and checks the headers of one engine's blocks."""

    def __init__(self, salt: bytes, layout: BlockLayout) -> None:
        self.salt_digest = hashlib.blake2b(salt, digest_size=16).digest()
        self.layout = layout
        self._layout_digest = layout.digest()

    def header(self, name: bytes, payload: memoryview) -> bytes:
        crc = zlib.crc32(payload)
        return _HEADER.pack(
            MAGIC, VERSION, self.salt_digest, name, self._layout_digest, len(payload), crc
        )

    def payload(self, name: bytes, data: bytes | memoryview) -> memoryview:
        """The payload of a stored block (`data`: header and payload), or BlockError."""
        view = memoryview(data)
        if len(view) < HEADER_BYTES:
            raise BlockError("truncated", f"{len(view)} bytes, shorter than a block header")
        return self.check(name, view[:HEADER_BYTES], view[HEADER_BYTES:])

    def check(self, name: bytes, header: bytes | memoryview, payload: memoryview) -> memoryview:
        """`payload` if `header` is this engine's header of block `name` over it; else
        BlockError."""
        magic, version, salt, stored_name, layout, size, crc = _HEADER.unpack_from(header)
        if magic != MAGIC or version != VERSION:
            raise BlockError(
                "corrupt", f"not a plait KV block (magic {magic!r}, version {version})"
            )
        if salt != self.salt_digest or layout != self._layout_digest:
            raise BlockError("foreign", "written by another model, KV dtype or page size")
        if stored_name != name:
            raise BlockError("corrupt", "the header names another block")
        if size != self.layout.payload_bytes:
            raise BlockError(
                "corrupt",
                f"header says {size} payload bytes, the layout {self.layout.payload_bytes}",
            )
        if len(payload) != size:
            kind = "truncated" if len(payload) < size else "corrupt"
            raise BlockError(kind, f"payload of {len(payload)} bytes, expected {size}")
        if zlib.crc32(payload) != crc:
            raise BlockError("corrupt", "payload checksum mismatch")
        return payload


def declared_size(header: bytes | memoryview) -> int:
    """The payload size a block header declares (unchecked: `BlockCodec.check` checks it)."""
    return _HEADER.unpack_from(header)[5]
