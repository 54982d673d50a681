"""The ctypes mirrors of the native kernels' structures and codes against the library's own
account of them (`csrc/plait_kernels.h`, reported by `csrc/cpu_abi.cpp`): a field added, moved or
retyped on one side only fails here instead of corrupting a decode step."""

from __future__ import annotations

import ctypes

import pytest
import torch

from plait.kernels import decode_stack, native, quant_matmul, quant_weights, tuning
from plait.kernels.kv_cache import kv_type_code

pytestmark = pytest.mark.skipif(
    native.load("cpu_kernels") is None, reason="native kernels unavailable"
)

STRUCTS = {
    "PlaitQLinear": decode_stack.QLinear,
    "PlaitDecodeLayer": decode_stack.DecodeLayer,
    "PlaitDecodeShape": decode_stack.DecodeShape,
    "PlaitDecodeBurst": decode_stack.DecodeBurst,
    "PlaitDecodeRows": decode_stack.DecodeRows,
    "PlaitMoE": decode_stack.MoE,
}


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_struct_layout_matches_the_library(name: str) -> None:
    mirror = STRUCTS[name]
    fields = [f[0] for f in mirror._fields_]
    size, offsets = native.abi_layout(name, fields)
    assert ctypes.sizeof(mirror) == size
    assert {f: getattr(mirror, f).offset for f in fields} == offsets


def test_every_library_field_is_mirrored() -> None:
    # a field the library has but the mirror lacks shows up as a size mismatch above unless it
    # sits in padding; a name the library does not know raises
    with pytest.raises(KeyError):
        native.abi_layout("PlaitQLinear", ["no_such_field"])
    with pytest.raises(KeyError):
        native.abi_constant("no_such_constant")


def test_codes_match_the_library() -> None:
    for fmt, code in quant_weights.FORMAT_CODE.items():
        assert native.abi_constant(f"format_{fmt}") == code
    for name, dtype in (
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("int8", torch.int8),
    ):
        assert native.abi_constant(f"kv_{name}") == kv_type_code(dtype)
    assert native.abi_constant("q8_block") == quant_weights.Q8_BLOCK
    for name, code in decode_stack.ACTIVATION_CODE.items():
        assert native.abi_constant(f"act_{name}") == code


def test_row_thresholds_follow_the_library() -> None:
    """On AVX2 the kernel rounds x to int8 up to `avx2_max_q8_rows` rows; the dequantized GEMM takes
    over right after (with VNNI the kernel takes every row count)."""
    avx2_rows = native.abi_constant("avx2_max_q8_rows")
    assert tuning.DEQUANT_GEMM_MIN_ROWS == avx2_rows + 1
    isa = quant_matmul.native_isa()
    expected = {"avx2": avx2_rows, "portable": 0}.get(isa)
    if expected is not None:
        assert quant_matmul.q8_max_rows() == expected
    else:
        assert quant_matmul.q8_max_rows() > 1 << 30
