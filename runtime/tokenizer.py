"""Text <-> token ids for one model, its special tokens and its chat template.

A `Tokenizer` wraps a fast (Rust) `tokenizers.Tokenizer`. It is built either from a GGUF file's
metadata (vocabulary, merges, token types) or from a local Hugging Face checkpoint directory;
the backends themselves are built in `tokenizer_backends.py`.
BOS is added by `encode` itself, never by the backend's post-processor, so it is never doubled.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from plait.runtime.chat_template import render_chat_template
from plait.runtime.tokenizer_backends import (
    PRE_LLAMA3,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_USER_DEFINED,
    Spelling,
    backend_from_transformers,
    gguf_byte_level_backend,
    gguf_sentencepiece_backend,
    post_processor_prepends,
    spelling_of,
)
from plait.runtime.tuning import GIL_FREE_CHARS

_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """One model's tokenizer: ids, special tokens, raw token bytes and the chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
        special_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
        spelling: Spelling = "byte_level",
        vocab_size: int | None = None,
    ) -> None:
        if not eos_token_ids:
            raise ValueError(
                "Tokenizer: eos_token_ids is empty; a model needs an end-of-sequence id"
            )
        if add_bos_token and bos_token_id is None:
            raise ValueError("Tokenizer: add_bos_token is set but the model has no bos_token_id")
        self.backend = backend
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_ids[0]
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(special_token_ids) | {
            i for i, token in added.items() if token.special
        }
        self.added_token_ids = frozenset(added)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.spelling = spelling
        # built on first use (a walk of the whole vocabulary, for constrained decoding only),
        # under the lock: the grammar tools' thread and a caller's may ask at once
        self._vocab_bytes: list[bytes] | None = None
        self._vocab_bytes_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={sorted(self.eos_token_ids)}, spelling={self.spelling!r})"
        )

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self.backend.id_to_token(self.eos_token_id)

    # text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in `text` (e.g. "<|im_start|>") always become their single id."""
        if len(text) >= GIL_FREE_CHARS:
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids) if add_special_tokens else ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        if add_special_tokens:
            return [self._with_bos(e.ids) for e in encodings]
        return [e.ids for e in encodings]

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Ids to text; bytes that do not form valid UTF-8 become U+FFFD.

        `spaces_between_special_tokens` is accepted for SGLang/vLLM protocol compatibility and, as
        with every fast (Rust) Hugging Face tokenizer those servers use, changes nothing.
        """
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(i) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for (an added token: its UTF-8 content)."""
        return self.vocab_bytes()[token_id]

    def vocab_bytes(self) -> list[bytes]:
        """`token_bytes` for every id below `vocab_size`, built once (b"" where an id has no
        token)."""
        vocab = self._vocab_bytes
        if vocab is None:
            with self._vocab_bytes_lock:
                if self._vocab_bytes is None:
                    self._vocab_bytes = [self._spell_bytes(i) for i in range(self.vocab_size)]
                vocab = self._vocab_bytes
        return vocab

    def _spell_bytes(self, token_id: int) -> bytes:
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self.added_token_ids or self.spelling == "plain":
            return token.encode("utf-8")
        if self.spelling == "byte_level":
            table = _unicode_to_byte()
            if all(ch in table for ch in token):
                return bytes(table[ch] for ch in token)
            return token.encode("utf-8")
        byte = _SPM_BYTE.fullmatch(token)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")

    # chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` the way transformers does; ids come without an extra BOS.

        `continue_final_message` leaves the last message open (no end-of-turn) so generation
        continues it; it implies no generation prompt.
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                "chat template: the model has no chat template (no tokenizer.chat_template in the "
                "GGUF, no chat_template in tokenizer_config.json / chat_template.jinja: a base "
                "model takes plain text completions); pass chat_template= to render chats"
            )
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context = {k: v for k, v in special.items() if v is not None}
        context.update(kwargs)
        text = render_chat_template(
            template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **context,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # constructors

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """From a GGUF's metadata: key -> `GGUFReader(path).fields[key].contents()`."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ValueError("GGUF metadata: tokenizer.ggml.tokens is missing or empty")
        types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
        pre = meta.get("tokenizer.ggml.pre")
        if kind == "gpt2":
            backend = gguf_byte_level_backend(tokens, meta.get("tokenizer.ggml.merges") or [], pre)
            spelling: Spelling = "byte_level"
            default_add_bos = pre in PRE_LLAMA3
        elif kind == "llama":
            backend = gguf_sentencepiece_backend(tokens, types, meta)
            spelling = "sentencepiece"
            default_add_bos = True
        else:
            raise NotImplementedError(
                f"GGUF metadata: tokenizer.ggml.model={kind!r} is not supported "
                f"(supported: 'gpt2' byte-level BPE, 'llama' sentencepiece BPE)"
            )
        control = [i for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)]
        user = [i for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i in control]
        )
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

        def optional_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return None if value is None or not 0 <= int(value) < len(tokens) else int(value)

        eos = optional_id("eos_token_id")
        eos_ids = [
            i
            for i in (eos, optional_id("eot_token_id"), optional_id("eom_token_id"))
            if i is not None
        ]
        if not eos_ids:
            raise ValueError("GGUF metadata: tokenizer.ggml.eos_token_id is missing")
        bos = optional_id("bos_token_id")
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        return cls(
            backend,
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            bos_token_id=bos,
            pad_token_id=optional_id("padding_token_id"),
            special_token_ids=control,
            add_bos_token=bool(default_add_bos if add_bos is None else add_bos) and bos is not None,
            chat_template=meta.get("tokenizer.chat_template"),
            spelling=spelling,
            vocab_size=len(tokens),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a local Hugging Face checkpoint directory (nothing is downloaded)."""
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"tokenizer: {root} is not a directory")
        config = _read_json(root / "tokenizer_config.json")
        if (root / "tokenizer.json").is_file():
            backend = BackendTokenizer.from_file(str(root / "tokenizer.json"))
        elif (root / "tokenizer.model").is_file():
            backend = backend_from_transformers(root)
        else:
            raise FileNotFoundError(
                f"tokenizer: {root} has neither tokenizer.json nor tokenizer.model"
            )
        generation = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")

        def id_of(token: Any) -> int | None:
            content = token.get("content") if isinstance(token, dict) else token
            return backend.token_to_id(content) if isinstance(content, str) else None

        def config_ids(key: str) -> list[int]:
            found: list[int] = []
            for source in (generation, model_config):
                value = source.get(key)
                found += [
                    v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)
                ]
            return found

        eos = id_of(config.get("eos_token"))
        eos_ids = list(
            dict.fromkeys(([eos] if eos is not None else []) + config_ids("eos_token_id"))
        )
        if not eos_ids:
            raise ValueError(
                f"tokenizer: {root} names no eos token (tokenizer_config.json eos_token, "
                f"generation_config.json / config.json eos_token_id)"
            )
        bos = id_of(config.get("bos_token"))
        if bos is None:
            bos = next(iter(config_ids("bos_token_id")), None)
        pad = id_of(config.get("pad_token"))
        if pad is None:
            pad = next(iter(config_ids("pad_token_id")), None)
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = bos is not None and post_processor_prepends(backend, bos)
        special = [
            int(k)
            for k, v in (config.get("added_tokens_decoder") or {}).items()
            if v.get("special")
        ]
        return cls(
            backend,
            eos_token_ids=eos_ids,
            bos_token_id=bos,
            pad_token_id=pad,
            special_token_ids=special,
            add_bos_token=add_bos and bos is not None,
            chat_template=_read_chat_template(root, config),
            spelling=spelling_of(backend),
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"tokenizer: {path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _read_chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(root / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverts GPT-2's byte -> printable character table, which spells byte-level BPE tokens."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    table: dict[str, int] = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table
