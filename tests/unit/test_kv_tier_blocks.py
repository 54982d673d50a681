"""Stored KV blocks without a model: the header's checks, the disk tier's files and size limit."""

from __future__ import annotations

import os
import zlib

import pytest

from plait.runtime.config import parse_size
from plait.runtime.kv_tiers import BlockCodec, BlockError, BlockLayout
from plait.runtime.kv_tiers.disk import DiskTier

LAYOUT = BlockLayout(
    num_layers=2,
    num_kv_heads=1,
    head_dim=4,
    dtype="float32",
    itemsize=4,
    page_size=2,
    block_pages=2,
    scales=False,
)


def stored(codec: BlockCodec, name: bytes, fill: int = 7) -> bytes:
    payload = memoryview(bytes([fill]) * LAYOUT.payload_bytes)
    return codec.header(name, payload) + bytes(payload)


def test_codec_refuses_truncated_corrupt_and_foreign_blocks():
    codec = BlockCodec(b"salt-a", LAYOUT)
    name = b"n" * 16
    data = stored(codec, name)
    assert bytes(codec.payload(name, data)) == bytes([7]) * LAYOUT.payload_bytes
    cases = {
        "truncated": [data[:-1], data[:10]],
        "corrupt": [data[:-1] + b"\0", data + b"x", b"XXXX" + data[4:], data],
        "foreign": [stored(BlockCodec(b"salt-b", LAYOUT), name)],
    }
    other_layout = BlockLayout(**{**LAYOUT.__dict__, "dtype": "bfloat16", "itemsize": 2})
    cases["foreign"].append(stored(BlockCodec(b"salt-a", other_layout), name))
    for kind, blobs in cases.items():
        for blob in blobs:
            asked = b"m" * 16 if blob is data else name  # the right bytes under another name
            with pytest.raises(BlockError) as err:
                codec.payload(asked, blob)
            assert err.value.kind == kind
    assert zlib.crc32(codec.payload(name, data)) == zlib.crc32(bytes([7]) * LAYOUT.payload_bytes)


def test_disk_tier_stores_finds_and_keeps_to_its_size(tmp_path):
    codec = BlockCodec(b"salt", LAYOUT)
    size = len(stored(codec, b"a" * 16))
    tier = DiskTier(str(tmp_path), capacity_bytes=3 * size)
    assert tier.wait_indexed(10)
    names = [bytes([i]) * 16 for i in range(5)]
    for name in names:
        data = stored(codec, name)
        assert tier.put(
            name, data[: -LAYOUT.payload_bytes], memoryview(data)[-LAYOUT.payload_bytes :]
        )
        tier.get([names[0]])  # the first stays the most recently used
    assert tier.usage() == (3, 3 * size)
    assert tier.contains(names) == [True, False, False, True, True]
    assert tier.get(names[:2]) == [stored(codec, names[0]), None]
    tier.discard(names[0])
    assert tier.contains(names[:1]) == [False] and tier.usage() == (2, 2 * size)
    # a later process learns what is there in the background, oldest first
    again = DiskTier(str(tmp_path), capacity_bytes=3 * size)
    assert again.wait_indexed(10) and again.usage() == (2, 2 * size)
    assert again.stats.snapshot()["failures"] == 0
    assert sorted(os.listdir(tmp_path / "tmp")) == []


@pytest.mark.parametrize(
    ("text", "expected"), [("20G", 20 << 30), ("512m", 512 << 20), ("1.5KiB", 1536), (4096, 4096)]
)
def test_parse_size(text, expected):
    assert parse_size("kv_disk_size", text) == expected


@pytest.mark.parametrize("bad", ["", "G", "-1G", "twenty", 0, True])
def test_parse_size_names_the_field(bad):
    with pytest.raises(ValueError, match="kv_disk_size"):
        parse_size("kv_disk_size", bad)


def test_salt_follows_the_weights_and_what_decides_kv(tmp_path):
    from dataclasses import dataclass

    from plait.runtime.kv_tiers.fingerprint import kv_salt, weights_fingerprint

    @dataclass
    class Args:
        rope_theta: float = 10000.0

    big = os.urandom(3 << 20)  # sampled, not read whole
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model.safetensors").write_bytes(big)
    (tmp_path / "copy.gguf").write_bytes(big)
    changed = bytearray(big)
    changed[0] ^= 1  # one bit of its first MiB
    (tmp_path / "other.gguf").write_bytes(bytes(changed))
    a = weights_fingerprint(str(tmp_path / "a"))
    assert a == weights_fingerprint(str(tmp_path / "a"))
    assert weights_fingerprint(str(tmp_path / "copy.gguf")) == a  # its bytes, not its path
    assert weights_fingerprint(str(tmp_path / "other.gguf")) != a
    base = dict(
        dtype="float32", quantization=None, kv_dtype="float32", page_size=16, device_type="cpu"
    )
    salt = kv_salt(a, Args(), **base)
    assert salt == kv_salt(a, Args(), **base)
    for change in ({"kv_dtype": "bfloat16"}, {"page_size": 1}, {"quantization": "int4"}):
        assert kv_salt(a, Args(), **{**base, **change}) != salt
    assert kv_salt(a, Args(rope_theta=1e6), **base) != salt
