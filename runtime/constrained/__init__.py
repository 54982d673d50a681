"""Constrained decoding: regex / JSON schema / choices / dtype -> token automata, masks,
jump-forward.

    key = make_grammar_key(json_schema=Person)             # submit time; raises GrammarError
    future = cache.get_future(key)                         # compiles off the engine loop
    grammar = future.result().new_grammar()                # per request
    grammar.fill_bitmask(bitmask, row); grammar.advance(token_id); jump_forward(grammar, tokenizer)

See docs/constrained.md.
"""

from ..protocol import JSON_WHITESPACE
from .base import (
    CompiledGrammar,
    Grammar,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    InvalidRegexError,
    InvalidSchemaError,
    TokenRejectedError,
    UnsupportedSchemaError,
    available_grammar_backends,
    create_grammar_backend,
    register_grammar_backend,
)
from .cache import GrammarCache, GrammarCacheStats
from .json_schema import json_schema_to_regex, normalize_json_schema
from .jump_forward import JumpForward, Retokenized, jump_forward, retokenize
from .spec import grammar_key_to_regex, make_grammar_key

__all__ = [
    "JSON_WHITESPACE",
    "CompiledGrammar",
    "Grammar",
    "GrammarBackend",
    "GrammarCache",
    "GrammarCacheStats",
    "GrammarError",
    "GrammarKey",
    "InvalidRegexError",
    "InvalidSchemaError",
    "JumpForward",
    "Retokenized",
    "TokenRejectedError",
    "UnsupportedSchemaError",
    "available_grammar_backends",
    "create_grammar_backend",
    "grammar_key_to_regex",
    "json_schema_to_regex",
    "jump_forward",
    "make_grammar_key",
    "normalize_json_schema",
    "register_grammar_backend",
    "retokenize",
]
