"""The `tokenizers` backends a `Tokenizer` wraps: built from a GGUF file's vocabulary (byte-level
BPE with llama.cpp's named pre-tokenizers, or sentencepiece BPE), or read from a checkpoint that
has only `tokenizer.model` (through `transformers`), and how a backend spells its tokens."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from plait.runtime.thirdparty import import_transformers

# llama.cpp's `tokenizer.ggml.token_type` values.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

Spelling = Literal["byte_level", "sentencepiece", "plain"]

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` names (llama.cpp) grouped by the pre-tokenizer of the original HF tokenizer.
# Starcoder-like (SmolLM2 too): every \p{N} alone (HF: `Digits(individual_digits=True)`), then
# GPT-2.
_PRE_STARCODER = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_PRE_GPT2 = ("gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion")
PRE_LLAMA3 = ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe")
_PRE_QWEN2 = ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")


def gguf_byte_level_backend(
    tokens: list[str], merges: list[str], pre: str | None
) -> BackendTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(models.BPE(vocab, pairs, ignore_merges=pre in PRE_LLAMA3))
    if pre in _PRE_STARCODER:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in _PRE_GPT2:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in PRE_LLAMA3 or pre in _PRE_QWEN2:
        split = _LLAMA3_SPLIT if pre in PRE_LLAMA3 else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if pre in _PRE_QWEN2:  # as Qwen2's tokenizer.json (llama.cpp does not normalize)
            backend.normalizer = normalizers.NFC()
    else:
        known = _PRE_STARCODER + _PRE_GPT2 + PRE_LLAMA3 + _PRE_QWEN2
        raise NotImplementedError(
            f"GGUF metadata: tokenizer.ggml.pre={pre!r} is not supported; known: {', '.join(known)}"
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def gguf_sentencepiece_backend(
    tokens: list[str], types: list[int], meta: Mapping[str, Any]
) -> BackendTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = list(meta.get("tokenizer.ggml.scores") or [])
        if len(scores) != len(tokens):
            raise ValueError(
                "GGUF metadata: a 'llama' tokenizer needs tokenizer.ggml.scores or merges"
            )
        merges = _merges_from_scores(tokens, types, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = BackendTokenizer(
        models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # NOTE: a normalizer, not `Metaspace`: sentencepiece and llama.cpp add the prefix even to text
    # that already starts with a space ("  a" -> "▁▁▁a"); `Metaspace` does not.
    spaces = normalizers.Replace(" ", "\u2581")
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if prefix_space else spaces
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(
    tokens: list[str], types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """Sentencepiece BPE merges the pair whose joined piece scores highest: rank merges that way."""
    normal = {t for t, kind in zip(tokens, types) if kind == TOKEN_TYPE_NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, kind, score in zip(tokens, types, scores):
        if kind != TOKEN_TYPE_NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-score, -len(left), -len(right), left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def backend_from_transformers(root: Path) -> BackendTokenizer:
    try:
        AutoTokenizer = import_transformers().AutoTokenizer
    except ImportError as e:
        raise ImportError(
            f"tokenizer: {root} has only tokenizer.model; reading it needs `transformers` and "
            f"`sentencepiece` (or save a tokenizer.json)"
        ) from e
    loaded = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"tokenizer: transformers read {root} as {type(loaded).__name__}, not a fast tokenizer"
        )
    return backend


def post_processor_prepends(backend: BackendTokenizer, token_id: int) -> bool:
    with_special = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return bool(with_special) and with_special[0] == token_id and without[:1] != [token_id]


def spelling_of(backend: BackendTokenizer) -> Spelling:
    if backend.decoder is None:
        return "plain"
    state = backend.decoder.__getstate__().decode("utf-8")
    if '"ByteLevel"' in state:
        return "byte_level"
    if '"ByteFallback"' in state or '"Metaspace"' in state or "\u2581" in state:
        return "sentencepiece"
    return "plain"
