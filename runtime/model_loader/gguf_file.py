"""Reading a GGUF file's header and tensors, fast: the metadata as Python values, each tensor as a
view of the memory-mapped file, and dequantization over all of a tensor's blocks at once.

The `gguf` package reads the same format, but one element at a time, which makes a large
vocabulary (Gemma 3's 262,144 tokens) slow to parse, and its `dequantize` works through 16 rows at
a time. Here the header is parsed with `struct` over the mapped bytes (numeric arrays in one
`np.frombuffer`), and `dequantize` hands large runs of blocks to the `gguf` package's own
per-block code (so the floats are the ones `gguf.quants.dequantize` gives, bit for bit) on a few
threads.

Layout (little-endian, versions 2 and 3): magic `GGUF`, version u32, tensor count u64, metadata
count u64; the metadata (key string, value type u32, value); the tensor infos (name string,
dimension count u32, dimensions u64 each, innermost first, type u32, offset u64 into the data);
the data, at the next multiple of `general.alignment` (32 by default).
"""

from __future__ import annotations

import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# value type -> (struct format, numpy dtype)
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),  # bool
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_BOOL = 7
_TYPED = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}
# blocks per task when dequantizing: large enough that numpy's per-call cost vanishes, small
# enough that the temporaries stay in cache-sized chunks
_DEQUANT_BLOCKS = 1 << 14
_DEQUANT_THREADS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    dims: tuple[int, ...]  # rows first, as torch orders them
    # as `gguf.GGUFReader` gives it: F32 / F16 / integer types typed and shaped `dims`; block
    # types as uint8 [..., bytes per row]
    data: np.ndarray


class GgufFile:
    """A GGUF file, memory-mapped: `meta` (key -> value) and `tensors`, read from its header.
    A file that is not a readable GGUF raises ValueError saying what is wrong with it."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise ValueError(str(exc) or type(exc).__name__) from None
        buf = self._map
        if buf[:4] != _MAGIC:
            raise ValueError(f"magic {bytes(buf[:4])!r}, expected b'GGUF'")
        try:
            (self.version,) = struct.unpack_from("<I", buf, 4)
            if self.version not in (2, 3):
                raise ValueError(f"GGUF version {self.version}; plait reads 2 and 3, little-endian")
            self.meta, self.tensors = self._parse(buf)
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"a truncated or corrupt header: {exc}") from None

    def _parse(self, buf: mmap.mmap) -> tuple[dict[str, Any], list[GgufTensor]]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        num_tensors, num_kv = struct.unpack_from("<QQ", buf, 8)
        offset = 24
        meta: dict[str, Any] = {}
        for _ in range(num_kv):
            key, offset = _string(buf, offset)
            (kind,) = struct.unpack_from("<I", buf, offset)
            meta[key], offset = _value(buf, offset + 4, kind)
        infos = []
        for _ in range(num_tensors):
            name, offset = _string(buf, offset)
            (ndim,) = struct.unpack_from("<I", buf, offset)
            ne = struct.unpack_from(f"<{ndim}Q", buf, offset + 4)
            kind, start = struct.unpack_from("<IQ", buf, offset + 4 + 8 * ndim)
            offset += 4 + 8 * ndim + 12
            infos.append((name, ne, kind, start))
        align = int(meta.get("general.alignment", 32))
        data_start = -(-offset // align) * align
        raw = np.frombuffer(buf, dtype=np.uint8)
        tensors = []
        for name, ne, kind, start in infos:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"tensor {name}: unknown GGML type {kind}") from None
            dims = tuple(int(d) for d in reversed(ne))
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(ne, dtype=np.int64))
            nbytes = count // block * type_size
            begin = data_start + start
            if begin + nbytes > len(raw):
                raise ValueError(f"tensor {name}: its data runs past the end of the file")
            chunk = raw[begin : begin + nbytes]
            if qtype.name in _TYPED:  # F32, F16, integer types: typed as they are
                data = chunk.view(_TYPED[qtype.name]).reshape(dims)
            else:
                data = chunk.reshape(*dims[:-1], dims[-1] // block * type_size)
            tensors.append(GgufTensor(name, qtype, dims, data))
        return meta, tensors


def _string(buf: mmap.mmap, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, offset)
    end = offset + 8 + length
    return buf[offset + 8 : end].decode("utf-8"), end


def _value(buf: mmap.mmap, offset: int, kind: int) -> tuple[Any, int]:
    if kind == _STRING:
        return _string(buf, offset)
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, offset)
        offset += 12
        if item in _SCALARS:  # numbers: one read
            dtype = np.dtype(_SCALARS[item][1])
            values = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
            out = values.astype(bool) if item == _BOOL else values
            return out.tolist(), offset + count * dtype.itemsize
        items = []
        for _ in range(count):
            value, offset = _value(buf, offset, item)
            if isinstance(value, list):  # arrays of arrays flatten, as the gguf package reads them
                items.extend(value)
            else:
                items.append(value)
        return items, offset
    if kind not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {kind} at byte {offset}")
    fmt = _SCALARS[kind][0]
    (value,) = struct.unpack_from(fmt, buf, offset)
    return value, offset + struct.calcsize(fmt)


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The metadata of the GGUF file at `path` (key -> value), as the `gguf` package reads it."""
    try:
        return GgufFile(path).meta
    except ValueError as exc:
        raise ValueError(f"{path}: not a GGUF file plait can read ({exc})") from None


def dequantize(tensor: GgufTensor) -> np.ndarray:
    """The tensor as float32, shaped `dims`: the floats `gguf.quants.dequantize` gives."""
    from gguf import quants

    name = tensor.tensor_type.name
    if name in ("F32", "F16", "F64"):
        return np.asarray(tensor.data, dtype=np.float32).reshape(tensor.dims)
    kind = quants._type_traits.get(tensor.tensor_type)  # the package's table of block types
    if kind is None:
        return quants.dequantize(tensor.data, tensor.tensor_type).reshape(tensor.dims)
    kind.init_grid()
    blocks = tensor.data.reshape(-1, kind.type_size)
    out = np.empty((blocks.shape[0], kind.block_size), dtype=np.float32)

    def run(start: int) -> None:
        stop = start + _DEQUANT_BLOCKS
        out[start:stop] = kind.dequantize_blocks(blocks[start:stop])

    starts = range(0, blocks.shape[0], _DEQUANT_BLOCKS)
    if len(starts) == 1:
        run(0)
    else:  # numpy releases the GIL inside each operation
        with ThreadPoolExecutor(_DEQUANT_THREADS) as pool:
            list(pool.map(run, starts))
    return out.reshape(tensor.dims)
