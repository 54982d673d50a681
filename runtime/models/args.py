"""The hyperparameters every family's model is built from, read from an HF config or GGUF metadata.

One frozen dataclass for all families: the fields most of them share (sizes, norms, rope) and the
few that set the building blocks a family uses (`qk_norm`, `activation`, `sliding_layers`, …).
Each family's file turns its checkpoint's config into one (`runtime/models/registry.py` picks the
family); the readers here cover the keys families spell alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # per rotary frequency, the divisor of its inverse frequency (GGUF `rope_freqs`: how llama.cpp
    # stores Llama 3's rope scaling); None: no such factors
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    # which layers attend through `sliding_window` (True) and which see everything; None: all of
    # them when there is a window
    sliding_layers: tuple[bool, ...] | None = None
    rope_local_theta: float | None = None  # rope base of the sliding layers, where it differs
    qk_norm: bool = False  # RMSNorm over each query and key head before rotary (Qwen3, Gemma 3)
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden))
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) where set
    # mixture of experts (Mixtral, Qwen3-MoE): each token's MLP is the weighted sum of
    # `num_experts_per_tok` of `num_experts` gated MLPs of `moe_intermediate_size`, picked by a
    # softmax router (the picked weights renormalized to sum to 1 where `norm_topk_prob`)
    num_experts: int = 0  # 0: a dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # None: intermediate_size
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] | None = None  # which layers are sparse; None: all of them
    architecture: str = "LlamaForCausalLM"  # the HF class name of the checkpoint's model
    family: str = "llama"  # the registry entry that builds it

    def __post_init__(self) -> None:
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation: {self.activation!r} is not one of silu, gelu_tanh")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(
                f"sliding_layers: {len(self.sliding_layers)} entries for {self.num_layers} layers"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be in [1, {self.num_experts}] (num_experts), "
                f"got {self.num_experts_per_tok}"
            )
        if self.moe_layers is not None and len(self.moe_layers) != self.num_layers:
            raise ValueError(
                f"moe_layers: {len(self.moe_layers)} entries for {self.num_layers} layers"
            )

    def is_moe(self, layer_id: int) -> bool:
        """Whether layer `layer_id`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer_id])

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window layer `layer_id` attends through, or None (all positions)."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is None or self.sliding_layers[layer_id]:
            return self.sliding_window
        return None

    @property
    def uniform_layers(self) -> bool:
        """Every layer attends alike (one window, one rope base)."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return len(windows) <= 1 and (self.rope_local_theta is None or windows == {None})


def rope_from_hf(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope base, scaling or None). transformers >= 5 writes `rope_parameters` (with rope_theta
    inside); older configs have `rope_theta` and `rope_scaling` at the top level."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    return theta, rope or None


def sliding_window_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """`sliding_window` and `sliding_layers` from config.json: its window (unless
    `use_sliding_window` is false) and, where it lists `layer_types`, which layers slide."""
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    types = config.get("layer_types")
    if window is None or not types:
        return {"sliding_window": window, "sliding_layers": None}
    sliding = tuple(t == "sliding_attention" for t in types)
    if not any(sliding):
        return {"sliding_window": None, "sliding_layers": None}
    return {"sliding_window": window, "sliding_layers": None if all(sliding) else sliding}


def common_from_hf(config: dict[str, Any], architecture: str, family: str) -> dict[str, Any]:
    """The `ModelArgs` fields every family reads from config.json under the same keys."""
    num_heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    theta, scaling = rope_from_hf(config)
    return dict(
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        architecture=architecture,
        family=family,
    )


def common_from_gguf(meta: dict[str, Any], architecture: str, family: str) -> dict[str, Any]:
    """The `ModelArgs` fields every family reads from GGUF metadata under `<arch>.` keys."""
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    scaling = None
    kind = get("rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif kind == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": get("rope.scaling.factor"),
            "low_freq_factor": get("rope.scaling.low_freq_factor", 1.0),
            "high_freq_factor": get("rope.scaling.high_freq_factor", 4.0),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
    elif kind not in (None, "none"):
        raise ValueError(
            f"GGUF: {arch}.rope.scaling.type {kind!r} is not supported (linear, llama3)"
        )
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv") or num_heads,
        head_dim=get("attention.key_length") or hidden // num_heads,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=get("context_length", 4096),
        sliding_window=get("attention.sliding_window"),
        num_experts=get("expert_count") or 0,
        num_experts_per_tok=get("expert_used_count") or 0,
        moe_intermediate_size=get("expert_feed_forward_length"),
        norm_topk_prob=bool(get("expert_weights_norm", True)),  # llama.cpp's default for these
        architecture=architecture,
        family=family,
    )
