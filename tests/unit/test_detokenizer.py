"""IncrementalDetokenizer: streamed pieces add up to the one-shot decode, never with half a
character."""

from __future__ import annotations

import random

import pytest

from plait.runtime.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from plait.runtime.tokenizer import Tokenizer

MULTIBYTE_TEXTS = [
    "emoji 😀👍🏽 and a family 👨\u200d👩\u200d👧 🇫🇷!",
    "日本語のテキスト 你好，世界。한국어 텍스트",
    "Ωμέγα Привет naïve café ½ ¾ — “quotes” … ✓",
    "mixed: def f(x): return '🐍' * 3  # 蛇\n\n  end",
]


@pytest.fixture(scope="module")
def tok(smollm_tokenizer: Tokenizer) -> Tokenizer:
    return smollm_tokenizer


@pytest.fixture(scope="module")
def byte_ids(tok: Tokenizer) -> dict[int, int]:
    """byte -> the id of SmolLM2's single-byte token for it."""
    return {
        b[0]: i
        for i, b in enumerate(tok.vocab_bytes())
        if len(b) == 1 and i not in tok.special_token_ids
    }


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None
) -> list[str]:
    pieces, start = [], 0
    for size in chunks or [1] * len(ids):
        pieces.append(detok.add(ids[start : start + size]))
        start += size
    assert start == len(ids)
    pieces.append(detok.flush())
    return pieces


def as_byte_tokens(text: str, byte_ids: dict[int, int]) -> list[int]:
    return [byte_ids[b] for b in text.encode("utf-8")]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_valid_text_streams_without_replacement_characters(tok, byte_ids, text: str) -> None:
    for ids in (tok.encode(text), as_byte_tokens(text, byte_ids)):
        detok = IncrementalDetokenizer(tok)
        pieces = stream(detok, ids)
        assert "".join(pieces) == text == detok.text == tok.decode(ids)
        assert not any("\ufffd" in piece for piece in pieces)


def test_a_split_character_is_held_back_until_complete(tok, byte_ids) -> None:
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in as_byte_tokens("a😀b", byte_ids)]
    assert pieces == ["a", "", "", "", "😀", "b"]


def test_several_ids_at_once_emit_the_complete_part(tok, byte_ids) -> None:
    detok = IncrementalDetokenizer(tok)
    emoji = as_byte_tokens("😀", byte_ids)
    assert detok.add(tok.encode("Hi ") + emoji[:2]) == "Hi "
    assert detok.add(emoji[2:]) == "😀"


def test_flush_turns_an_incomplete_tail_into_replacement(tok, byte_ids) -> None:
    ids = tok.encode("ok ") + as_byte_tokens("😀", byte_ids)[:3]
    detok = IncrementalDetokenizer(tok)
    pieces = stream(detok, ids)
    assert pieces[-1] == "\ufffd"
    assert "".join(pieces) == tok.decode(ids) == "ok \ufffd"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_concatenate_to_the_full_decode(tok, skip_special_tokens: bool) -> None:
    rng = random.Random(1234)
    for _ in range(40):
        ids = rng.choices(range(tok.vocab_size), k=rng.randint(1, 120))
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(min(rng.randint(1, 4), len(ids) - sum(chunks)))
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(stream(detok, ids, chunks)) == expected


def test_random_multibyte_byte_tokens_concatenate_to_the_full_decode(tok, byte_ids) -> None:
    rng = random.Random(7)
    alphabet = "aé中😀 \n"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = as_byte_tokens(text, byte_ids)
        assert "".join(stream(IncrementalDetokenizer(tok), ids)) == text


def test_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "assistant\nHi there"
    shown = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(shown, ids)) == "<|im_start|>assistant\nHi there<|im_end|>"


def test_prompt_context_does_not_change_byte_level_output(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>user\nSay hi 👋<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(" Hello 👋 world")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(stream(detok, ids)) == tok.decode(ids) == " Hello 👋 world"


def test_window_stays_small(tok: Tokenizer) -> None:
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 你好，世界 😀 " * 60)
    detok = IncrementalDetokenizer(tok)
    longest = 0
    for i in ids:
        detok.add([i])
        longest = max(longest, len(detok._window))
    assert longest <= 8
    assert detok.text + detok.flush() == tok.decode(ids)


def test_invalid_bytes_do_not_stall_the_stream(tok, byte_ids) -> None:
    lead = byte_ids[0xE4]  # a UTF-8 lead byte that never gets its continuation bytes
    detok = IncrementalDetokenizer(tok)
    emitted = "".join(detok.add([lead]) for _ in range(MAX_PENDING_TOKENS + 2))
    assert emitted and set(emitted) == {"\ufffd"}
    assert len(detok._window) <= 2


def test_sentencepiece_keeps_the_leading_space_after_a_prompt() -> None:
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "H", "i", "\u2581Hi", "\u2581there", "there"]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * 6 + [6] * 256,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    tok = Tokenizer.from_gguf_metadata(meta)
    prompt = tok.encode("Hi")
    output = tok.encode("there 😀", add_special_tokens=False)
    assert tok.decode(output) == "there 😀"
    pieces = stream(IncrementalDetokenizer(tok, prompt_ids=prompt), output)
    assert "".join(pieces) == " there 😀" == tok.decode(prompt + output)[len("Hi") :]
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(stream(IncrementalDetokenizer(tok), output)) == "there 😀"
