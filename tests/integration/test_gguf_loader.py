"""GGUF files of every supported tensor type load into weights that match transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plait.kernels.quant_matmul import DEQUANT_GEMM_MIN_ROWS
from plait.runtime.batch import ExtendEntry, ScheduleBatch
from plait.runtime.kv_pool import KVPool
from plait.runtime.model_loader import load_model
from plait.runtime.model_runner import ModelRunner
from tests.conftest import write_tiny_checkpoint
from tests.integration.test_model_parity import all_logits, request

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
}


_FAMILY_LAYER = {  # what llama.cpp calls the modules only some families have
    "qwen3": {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"},
    "qwen3moe": {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "gemma3": {
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
_PERMUTED = ("llama", "mistral")  # llama.cpp stores their q/k rows in interleaved-rope order


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in _NAMES:
        return _NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{({**_LAYER, **_FAMILY_LAYER.get(arch, {})})[module]}.{leaf}"


def llama3_rope_freqs(rope: dict, head_dim: int, theta: float) -> np.ndarray:
    """Llama 3's rope scaling as the per-frequency divisors a GGUF's `rope_freqs` holds: the
    factor for long wavelengths, 1 for short ones, and the smooth blend between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of q/k rows to interleaved-rope order."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    path, hf_model, tokenizer_meta: dict, qtype: str, arch: str = "llama"
) -> dict[str, torch.Tensor]:
    """Writes hf_model as a GGUF of `arch`; returns the weights as the file stores them,
    dequantized."""
    import gguf

    cfg = hf_model.config
    kind = gguf.GGMLQuantizationType[qtype]
    permuted = arch in _PERMUTED
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters.get(
        "full_attention", cfg.rope_parameters
    )  # Gemma 3: the global layers'
    theta = rope.get("rope_theta", 10000.0)
    writer.add_rope_freq_base(theta)
    if (
        arch == "gemma3"
    ):  # its sliding layers, and its logit cap; llama.cpp keeps their rope base at 10,000
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if cfg.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor(
            "rope_freqs.weight", llama3_rope_freqs(cfg.rope_parameters, head_dim, theta)
        )
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokenizer_meta["tokenizer.ggml.tokens"])
    writer.add_token_types(tokenizer_meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(tokenizer_meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_meta["tokenizer.chat_template"])
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy()
        if ".mlp.experts." in name:  # [E, out, in]: llama.cpp's ffn_{gate,up,down}_exps
            stored[name] = write_experts(writer, name, w, kind if qtype != "F32" else None)
            continue
        if w.ndim == 1:
            # Gemma's norms multiply by (1 + w): llama.cpp stores 1 + w
            writer.add_tensor(
                gguf_name(name, arch), w + 1 if arch == "gemma3" and "norm" in name else w
            )
            stored[name] = tensor.float()
            continue
        if ".q_proj." in name and permuted:
            w = permute(w, cfg.num_attention_heads)
        elif ".k_proj." in name and permuted:
            w = permute(w, cfg.num_key_value_heads)
        if qtype == "F32":
            data, raw_dtype = w, None
        else:
            data = gguf.quants.quantize(w, kind)
            raw_dtype = kind
        writer.add_tensor(gguf_name(name, arch), data, raw_dtype=raw_dtype)
        # rows are quantized independently, so the permutation commutes with the round trip
        roundtrip = w if qtype == "F32" else gguf.quants.dequantize(data, kind)
        stored[name] = torch.from_numpy(np.array(roundtrip, dtype=np.float32)).reshape(tensor.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name in (
        list(stored) if permuted else []
    ):  # undo the permutation for the transformers reference
        heads = {".q_proj.": cfg.num_attention_heads, ".k_proj.": cfg.num_key_value_heads}
        for key, h in heads.items():
            if key in name:
                w = stored[name].numpy()
                rows = w.shape[0]
                stored[name] = torch.from_numpy(
                    np.ascontiguousarray(
                        w.reshape(h, rows // h // 2, 2, *w.shape[1:])
                        .swapaxes(1, 2)
                        .reshape(w.shape)
                    )
                )
    return stored


def write_experts(writer, name: str, w: np.ndarray, kind) -> torch.Tensor:
    """One layer's stacked experts (transformers holds gate and up as one [E, 2 I, H]) as the
    GGUF's 3-D tensors; returns them as stored."""
    import gguf

    layer = name.split(".")[2]
    if name.endswith("gate_up_proj"):
        pieces = {"ffn_gate_exps": w[:, : w.shape[1] // 2], "ffn_up_exps": w[:, w.shape[1] // 2 :]}
    else:
        pieces = {"ffn_down_exps": w}
    back = []
    for kind_name, piece in pieces.items():
        piece = np.ascontiguousarray(piece)
        data = piece if kind is None else gguf.quants.quantize(piece, kind)
        writer.add_tensor(f"blk.{layer}.{kind_name}.weight", data, raw_dtype=kind)
        back.append(piece if kind is None else gguf.quants.dequantize(data, kind))
    return torch.from_numpy(np.concatenate(back, axis=1).astype(np.float32))


@pytest.mark.parametrize(
    "qtype,quantization",
    [(t, "float32") for t in TYPES]
    + [("Q8_0", "int8"), ("Q4_0", "int4"), ("Q4_1", "int4"), ("Q5_0", None), ("Q4_1", None)],
)
def test_gguf_types_match_transformers(
    tmp_path, smollm_tokenizer, gguf_metadata, qtype, quantization, monkeypatch
):
    """Dequantized ("float32"), or kept in their blocks for the quantized kernels (None, the
    default, and "int8" / "int4")."""
    from plait.kernels import quant_matmul

    # the native kernels' rows: a bfloat16 GEMM (AMX machines) would blur a misread block's error
    monkeypatch.setattr(quant_matmul, "bf16_gemm_enabled", lambda: False)
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "llama", smollm_tokenizer, seed=3)
    assert_gguf_matches_transformers(
        tmp_path, hf_dir, gguf_metadata, qtype, quantization, "llama", smollm_tokenizer
    )


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}
FAMILIES = {  # GGUF architecture, family of the transformers checkpoint, its config overrides
    "llama3-rope": ("llama", "llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen3": ("qwen3", "qwen3", {"head_dim": 16}),
    "phi3": ("phi3", "phi3", {"sliding_window": 24}),
    # Mixtral's GGUF is a `llama` one with experts; Qwen3-MoE's has its own architecture
    "mixtral": ("llama", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3moe": (
        "qwen3moe",
        "qwen3moe",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        },  # as its released models and llama.cpp
    ),
    "gemma3": (
        "gemma3",
        "gemma3",
        {
            "head_dim": 32,
            "num_hidden_layers": 3,
            "sliding_window": 12,
            "query_pre_attn_scalar": 32,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "final_logit_softcapping": 30.0,
        },
    ),
}


@pytest.mark.parametrize("case", list(FAMILIES))
def test_family_ggufs_match_transformers(tmp_path, smollm_tokenizer, gguf_metadata, case):
    """Each family's GGUF names and layout (Llama 3's `rope_freqs`, Qwen3's q/k norms, Phi-3's
    fused `attn_qkv` and `ffn_up`) give transformers' logits."""
    arch, family, overrides = FAMILIES[case]
    hf_dir = write_tiny_checkpoint(
        tmp_path / "hf", family, smollm_tokenizer, seed=5, random_norms=True, **overrides
    )
    loaded = assert_gguf_matches_transformers(
        tmp_path, hf_dir, gguf_metadata, "Q8_0", "float32", arch, smollm_tokenizer
    )
    assert loaded.family.name == ("llama" if family == "mixtral" else family)
    if case == "llama3-rope":
        assert (
            loaded.args.rope_freq_factors is not None and max(loaded.args.rope_freq_factors) == 8.0
        )


def assert_gguf_matches_transformers(
    tmp_path, hf_dir, gguf_metadata, qtype, quantization, arch, tokenizer
):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    stored = write_gguf(tmp_path / f"tiny-{qtype}.gguf", hf, gguf_metadata, qtype, arch)
    hf.load_state_dict(stored)
    loaded = load_model(
        str(tmp_path / f"tiny-{qtype}.gguf"), torch.float32, torch.device("cpu"), quantization
    )
    tolerance = 1e-4
    if quantization != "float32":
        from plait.kernels.quant_matmul import QuantMatmul
        from plait.runtime.models.quantized import QuantExpertWeights, QuantLinear

        linears = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
        for m in linears:  # five-bit values where 64 divides K
            five = qtype.startswith("Q5") and m.in_features % 64 == 0
            assert m.format == ("int4" if qtype.startswith("Q4") else "int5" if five else "int8")
        # AVX-512 VNNI rounds x at any row count, AVX2 at a decode batch's: an expert sees a
        # share of the prompt's rows, a dense layer all of them
        experts = any(isinstance(m, QuantExpertWeights) for m in loaded.model.modules())
        rows = 1 if experts else DEQUANT_GEMM_MIN_ROWS
        if QuantMatmul(linears[0].qw).rounds_to_int8(rows):
            # two levels: 1/256 of a step of x (2.4e-3 seen); a misread block is off by O(1)
            tolerance = 1e-2
    # a prefill's worth of rows: on AVX2, fewer (a decode batch) would round x to int8 for the
    # quantized kernels
    ids = torch.randint(
        3, 49152, (1, DEQUANT_GEMM_MIN_ROWS), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ref = hf(ids).logits[0]
    args = loaded.args
    pool = KVPool(
        128,
        1,
        args.num_layers,
        args.num_kv_heads,
        args.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    runner = ModelRunner(loaded.model, pool, torch.device("cpu"), frozenset([2]), torch.Generator())
    req = request(ids[0].tolist(), 0, 1)
    ours = all_logits(
        runner, ScheduleBatch(extends=[ExtendEntry(req, 0, DEQUANT_GEMM_MIN_ROWS, True)])
    )
    assert (ours - ref).abs().max().item() < tolerance
    assert loaded.tokenizer.encode("Hello world") == tokenizer.encode("Hello world")
    return loaded


def test_unsupported_gguf_architecture_is_named(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama"):
        load_model(str(tmp_path / "x.gguf"), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("case", ["mixtral", "qwen3moe"])
def test_experts_keep_their_blocks_and_the_router_stays_float(
    tmp_path, smollm_tokenizer, gguf_metadata, case
):
    """By default a GGUF's Q8_0 experts run as stored, one quantized matrix per expert and
    projection (no float copy of the stack), while its Q8_0 router is read into float: the
    logits are still transformers' on the same blocks."""
    from plait.runtime.models.moe import SparseMoE
    from plait.runtime.models.quantized import QuantExpertWeights

    arch, family, overrides = FAMILIES[case]
    hf_dir = write_tiny_checkpoint(
        tmp_path / "hf", family, smollm_tokenizer, seed=5, random_norms=True, **overrides
    )
    loaded = assert_gguf_matches_transformers(
        tmp_path, hf_dir, gguf_metadata, "Q8_0", None, arch, smollm_tokenizer
    )
    moes = [m for m in loaded.model.modules() if isinstance(m, SparseMoE)]
    assert moes
    for moe in moes:
        assert type(moe.gate) is torch.nn.Linear and moe.gate.weight.abs().sum() > 0
        for projection in (moe.experts.gate_up_proj, moe.experts.down_proj):
            assert isinstance(projection, QuantExpertWeights)
            assert len(projection.experts) == loaded.args.num_experts
    per_expert = loaded.weight_types["Q8_0"]["int8 blocks as stored, per expert"]
    assert per_expert == 3 * len(moes)  # gate, up and down of each mixture
