"""What constrained decoding needs from a tokenizer, built when an engine starts: the grammar
backend and the engine's compile cache over it, the budget-closing search and the token healer.

Each walks the whole vocabulary (about a second for a 49k vocabulary), so they are built on a
thread of their own while the engine loads, once per process for a given tokenizer and setting
(engines alike share them; each engine keeps its own compile cache, shut down with it), and every
user waits for that one build instead of whichever thread asks first building its own.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from plait.runtime.config import EngineConfig
from plait.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class _Shared:
    backend: Any  # GrammarBackend
    closing: Any  # ClosingSearch
    healer: Any  # TokenHealer


@dataclass(frozen=True)
class ConstraintTools:
    grammars: Any  # GrammarCache over the shared backend: this engine's
    closing: Any  # ClosingSearch
    healer: Any  # TokenHealer


_lock = threading.Lock()
_shared: dict[tuple, Future[_Shared]] = {}
_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-constraints")


def start(tokenizer: Tokenizer, config: EngineConfig, vocab_size: int) -> Future[ConstraintTools]:
    """The tools of one engine, built off the caller's thread."""
    shared = _shared_tools(tokenizer, config, vocab_size)

    def build() -> ConstraintTools:
        from plait.runtime.constrained import GrammarCache

        tools = shared.result()
        return ConstraintTools(GrammarCache(tools.backend), tools.closing, tools.healer)

    return _pool.submit(build)


def _shared_tools(tokenizer: Tokenizer, config: EngineConfig, vocab_size: int) -> Future[_Shared]:
    sandboxed = config.grammar_compile_memory_mb > 0
    options = {
        "vocab_size": vocab_size,
        "max_digit_run": config.json_max_digit_run,
        "max_whitespace_run": config.json_max_whitespace_run,
        **(
            {
                "compile_timeout": config.grammar_compile_timeout,
                "compile_memory_mb": config.grammar_compile_memory_mb,
            }
            if sandboxed
            else {}
        ),
    }
    key = (_fingerprint(tokenizer), config.grammar_backend, tuple(sorted(options.items())))
    with _lock:
        found = _shared.get(key)
        if found is None or (found.done() and found.exception() is not None):
            found = _shared[key] = _pool.submit(_build, tokenizer, config.grammar_backend, options)
        return found


def _build(tokenizer: Tokenizer, backend_name: str, options: dict[str, Any]) -> _Shared:
    from plait.runtime.constrained import create_grammar_backend
    from plait.runtime.constrained.closing import ClosingSearch
    from plait.runtime.constrained.healing import TokenHealer

    backend = create_grammar_backend(backend_name, tokenizer, **options)
    closing = ClosingSearch(
        tokenizer.vocab_bytes(),
        (options["vocab_size"] + 31) // 32,
        excluded=tokenizer.special_token_ids | tokenizer.eos_token_ids,
    )
    return _Shared(backend, closing, TokenHealer(tokenizer))


def _fingerprint(tokenizer: Tokenizer) -> str:
    """The tokenizer's identity for sharing: what each token spells and its special tokens."""
    digest = hashlib.sha256()
    for spelled in tokenizer.vocab_bytes():
        digest.update(len(spelled).to_bytes(4, "little"))
        digest.update(spelled)
    digest.update(repr(sorted(tokenizer.special_token_ids)).encode())
    digest.update(repr(sorted(tokenizer.eos_token_ids)).encode())
    return digest.hexdigest()
