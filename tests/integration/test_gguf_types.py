"""Every tensor type the `gguf` package reads loads bit for bit as `gguf.quants.dequantize` gives it
(into float, or re-quantized into plait's int8/int4 blocks), `Engine.stats()`-style counts say
what each type became, and a file plait cannot run is refused from its header, naming the file
and the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plait.kernels.quant_weights import dequantize_ref, quantize_int4, quantize_int8
from plait.runtime.model_loader import gguf_loader, load_model
from plait.runtime.model_loader.gguf_blocks import BLOCK_TYPES
from plait.runtime.models.quantized import QuantLinear

HIDDEN, FFN, HEADS, KV_HEADS = 256, 256, 2, 1  # rows of 256: the k-quants' super-block
HEAD_DIM = HIDDEN // HEADS
CPU = torch.device("cpu")


def gguf_types() -> list[str]:
    from gguf import quants

    return sorted(t.name for t in quants._type_traits)  # every block type gguf dequantizes


def byte_tokens() -> list[str]:
    """A 256-token byte-level vocabulary (GPT-2's byte-to-unicode table), no merges."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def blocks(shape: tuple[int, int], qtype: str, seed: int) -> np.ndarray:
    """A [rows, K] matrix in `qtype`'s blocks: quantized by gguf where it can, else random bytes
    with bit 6 clear (every float16 or 8-bit-float scale inside them is then finite)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    try:
        return gguf.quants.quantize(rng.normal(0, 0.1, shape).astype(np.float32), kind)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
        return raw & np.uint8(0xBF)


def write_tiny_gguf(
    path, qtype: str, *, arch: str = "qwen2", skip=(), extra=None, types=None
) -> dict[str, np.ndarray]:
    """A one-layer model with its projections in `qtype` (`types`: another type for some, by GGUF
    name such as "attn_v"); returns {GGUF name: stored array}."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(byte_tokens())
    writer.add_token_merges([])
    writer.add_eos_token_id(0)
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": rng.normal(0, 1, (256, HIDDEN)).astype(np.float32),
        "output_norm.weight": np.ones(HIDDEN, np.float32),
        "blk.0.attn_norm.weight": np.ones(HIDDEN, np.float32),
        "blk.0.ffn_norm.weight": np.ones(HIDDEN, np.float32),
        "blk.0.attn_q.bias": np.zeros(HEADS * HEAD_DIM, np.float32),
        "blk.0.attn_k.bias": np.zeros(KV_HEADS * HEAD_DIM, np.float32),
        "blk.0.attn_v.bias": np.zeros(KV_HEADS * HEAD_DIM, np.float32),
    }
    shapes = {
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    quantized: dict[str, np.ndarray] = {}
    kinds: dict[str, gguf.GGMLQuantizationType] = {}
    for i, (kind_name, shape) in enumerate(shapes.items()):
        kind = (types or {}).get(kind_name, qtype)
        quantized[f"blk.0.{kind_name}.weight"] = blocks(shape, kind, seed=i)
        kinds[f"blk.0.{kind_name}.weight"] = gguf.GGMLQuantizationType[kind]
    stored = {}
    for name, array in {**tensors, **quantized, **(extra or {})}.items():
        if name in skip:
            continue
        if name in quantized and name not in (extra or {}):
            writer.add_tensor(name, array, raw_dtype=kinds[name])
            shape = shapes[name.split(".")[2]]
            stored[name] = gguf.quants.dequantize(array, kinds[name]).reshape(shape)
        else:
            writer.add_tensor(name, array)
            stored[name] = array
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def as_tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32))


@pytest.mark.parametrize("qtype", ["F16", *gguf_types()])
def test_every_type_loads_as_gguf_dequantizes_it(tmp_path, qtype):
    stored = write_tiny_gguf(tmp_path / "m.gguf", qtype)
    loaded = load_model(str(tmp_path / "m.gguf"), torch.float32, CPU, "float32")
    layer = loaded.model.model.layers[0]
    qkv = torch.cat([as_tensor(stored[f"blk.0.attn_{p}.weight"]) for p in "qkv"])
    gate_up = torch.cat([as_tensor(stored[f"blk.0.ffn_{p}.weight"]) for p in ("gate", "up")])
    for ours, theirs in [
        (layer.self_attn.qkv_proj.weight, qkv),
        (layer.self_attn.o_proj.weight, as_tensor(stored["blk.0.attn_output.weight"])),
        (layer.mlp.gate_up_proj.weight, gate_up),
        (layer.mlp.down_proj.weight, as_tensor(stored["blk.0.ffn_down.weight"])),
    ]:
        assert torch.equal(ours.detach(), theirs) or torch.allclose(
            ours.detach(), theirs, atol=0, rtol=0, equal_nan=True
        )
    assert loaded.weight_types[qtype] == {"float32": 7}
    assert loaded.weight_types["F32"] == {
        "float32": 8
    }  # norms, biases, the table and its tied head


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_by_default_the_kernels_block_types_stay_in_their_blocks(tmp_path, qtype):
    stored = write_tiny_gguf(tmp_path / "m.gguf", qtype)
    loaded = load_model(str(tmp_path / "m.gguf"), torch.float32, CPU)
    layer = loaded.model.model.layers[0]
    down = layer.mlp.down_proj
    assert isinstance(down, QuantLinear)
    assert torch.equal(dequantize_ref(down.qw), as_tensor(stored["blk.0.ffn_down.weight"]))
    scales = "" if qtype in ("Q4_0", "Q4_1", "Q8_0", "Q5_0") else ", float32 scales"
    assert loaded.weight_types[qtype] == {f"{down.format} blocks as stored{scales}": 7}
    assert loaded.weight_types["F32"] == {"float32": 8}  # the float table's tied head stays float
    assert isinstance(loaded.model.lm_head, torch.nn.Linear)


@pytest.mark.parametrize("q,v", [("Q4_K", "Q6_K"), ("Q5_0", "Q8_0")])
def test_a_fused_matrix_of_mixed_types_stays_in_blocks(tmp_path, q, v):
    """Q4_K_M's Q6_K v beside Q4_K q and k (Gemma 3's Q8_0 v beside Q5_0 q and k): the fused qkv
    is one int8 matrix holding each piece's weights exactly, not a float fallback."""
    stored = write_tiny_gguf(tmp_path / "m.gguf", q, types={"attn_v": v})
    loaded = load_model(str(tmp_path / "m.gguf"), torch.float32, CPU)
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.format == "int8"
    pieces = [stored[f"blk.0.attn_{p}.weight"] for p in "qkv"]
    assert torch.equal(dequantize_ref(qkv.qw), torch.cat([as_tensor(p) for p in pieces]))


def test_other_types_stay_float_by_default(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "IQ4_XS")
    loaded = load_model(str(tmp_path / "m.gguf"), torch.float32, CPU)
    assert loaded.weight_types["IQ4_XS"] == {"float32": 7}


@pytest.mark.parametrize(
    "qtype,quantization", [("Q4_K", "int4"), ("Q6_K", "int8"), ("IQ4_XS", "int4"), ("Q8_0", "int4")]
)
def test_other_types_are_requantized_from_their_exact_floats(tmp_path, qtype, quantization):
    stored = write_tiny_gguf(tmp_path / "m.gguf", qtype)
    loaded = load_model(str(tmp_path / "m.gguf"), torch.float32, CPU, quantization)
    down = loaded.model.model.layers[0].mlp.down_proj
    if qtype in BLOCK_TYPES:  # blocks plait's kernels read are kept as the file holds them
        scales = "" if qtype == "Q8_0" else ", float32 scales"
        assert loaded.weight_types[qtype] == {f"{down.format} blocks as stored{scales}": 7}
        expected = as_tensor(stored["blk.0.ffn_down.weight"])
    else:
        assert down.format == quantization
        assert loaded.weight_types[qtype] == {f"{quantization} quantized at load": 7}
        quantize = quantize_int4 if quantization == "int4" else quantize_int8
        expected = dequantize_ref(quantize(as_tensor(stored["blk.0.ffn_down.weight"])))
    assert torch.equal(dequantize_ref(down.qw), expected)


def test_stats_say_how_each_type_runs(tmp_path):
    from plait import Engine

    write_tiny_gguf(tmp_path / "m.gguf", "IQ4_XS")
    with Engine(
        model_path=str(tmp_path / "m.gguf"), quantization="int8", max_total_tokens=256
    ) as engine:
        out = engine.generate("ab", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        stats = engine.stats()
    assert len(out["output_ids"]) == 4
    assert stats["model_family"] == "qwen2"
    assert stats["weight_types"] == {
        "F32": {"float32": 7, "int8 quantized at load": 1},  # the tied head is quantized at load
        "IQ4_XS": {"int8 quantized at load": 7},
    }
    assert stats["execution_quantized_matmul"].startswith(("native", "torch reference"))


def test_a_file_that_is_not_a_gguf_is_named(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match=f"{tmp_path / 'broken.gguf'} is not a GGUF file"):
        load_model(str(tmp_path / "broken.gguf"), torch.float32, CPU)


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fails a test that reads a tensor's data: refusals come from the header alone."""

    def refuse(tensor):
        raise AssertionError(f"read {tensor.name} before refusing the file")

    monkeypatch.setattr(gguf_loader, "_dequantize", refuse)


def test_unknown_architecture_is_refused_before_any_weight_is_read(tmp_path, no_weight_reads):
    write_tiny_gguf(tmp_path / "m.gguf", "Q4_K", arch="gpt2")
    with pytest.raises(
        ValueError, match=r"m\.gguf: unsupported architecture 'gpt2'; plait supports llama, .*qwen3"
    ):
        load_model(str(tmp_path / "m.gguf"), torch.float32, CPU)


def test_unreadable_tensor_types_are_refused_in_one_line(tmp_path, no_weight_reads):
    extra = {
        "blk.0.attn_v.weight": np.zeros((KV_HEADS * HEAD_DIM, HIDDEN), dtype=np.int32)
    }  # type I32
    write_tiny_gguf(tmp_path / "m.gguf", "Q4_0", extra=extra)
    with pytest.raises(
        ValueError,
        match=r"m\.gguf: architecture 'qwen2' with tensors of types plait cannot read: "
        r"I32 \(e\.g\. blk\.0\.attn_v\.weight\)",
    ) as err:
        load_model(str(tmp_path / "m.gguf"), torch.float32, CPU)
    assert "\n" not in str(err.value)


def test_a_missing_tensor_is_named_with_its_file(tmp_path, no_weight_reads):
    write_tiny_gguf(tmp_path / "m.gguf", "Q4_0", skip={"blk.0.attn_v.weight"})
    with pytest.raises(ValueError, match=r"m\.gguf: missing tensor blk\.0\.attn_v\.weight$"):
        load_model(str(tmp_path / "m.gguf"), torch.float32, CPU)


def test_a_tensor_the_family_lacks_is_named_with_its_file(tmp_path, no_weight_reads):
    extra = {"blk.0.attn_q_norm.weight": np.ones(HEAD_DIM, np.float32)}  # Qwen3's, not Qwen2's
    write_tiny_gguf(tmp_path / "m.gguf", "Q4_0", extra=extra)
    with pytest.raises(
        ValueError,
        match=r"m\.gguf: tensor blk\.0\.attn_q_norm\.weight is not one the qwen2 family has",
    ):
        load_model(str(tmp_path / "m.gguf"), torch.float32, CPU)


def test_the_header_reads_as_the_gguf_package_reads_it(gguf_path):
    import gguf

    from plait.runtime.model_loader.gguf_file import GgufFile

    theirs = gguf.GGUFReader(gguf_path)
    ours = GgufFile(gguf_path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.meta == expected
    assert [type(v) for v in ours.meta.values()] == [type(v) for v in expected.values()]
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.data.dtype, a.data.shape) == (
            b.name,
            b.tensor_type,
            b.data.dtype,
            b.data.shape,
        )
        assert a.dims == tuple(reversed(b.shape.tolist()))
        assert np.array_equal(a.data, b.data)


@pytest.mark.parametrize("qtype", ["F16", "BF16", *gguf_types()])
def test_dequantizing_in_runs_of_blocks_is_bit_exact(tmp_path, monkeypatch, qtype):
    import gguf

    from plait.runtime.model_loader import gguf_file

    monkeypatch.setattr(gguf_file, "_DEQUANT_BLOCKS", 3)  # many runs, on several threads
    stored = write_tiny_gguf(tmp_path / "m.gguf", qtype)
    for tensor in gguf_file.GgufFile(str(tmp_path / "m.gguf")).tensors:
        ours = gguf_file.dequantize(tensor)
        theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tensor.dims)
        assert ours.dtype == np.float32 and ours.shape == stored[tensor.name].shape
        assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("content", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + b"\xff" * 16])
def test_an_empty_or_truncated_file_is_refused_by_name(tmp_path, content):
    (tmp_path / "cut.gguf").write_bytes(content)
    with pytest.raises(ValueError, match=r"cut\.gguf is not a GGUF file plait can read \(.+\)$"):
        load_model(str(tmp_path / "cut.gguf"), torch.float32, CPU)
