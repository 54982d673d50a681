"""Jump-forward decoding: append the text the grammar forces without sampling it, retokenizing at
the boundary so the output ids are what the tokenizer itself would produce for the output text.

    forced `"name":"` after `{`:  old ids [`{`]  ->  encode(`{"name":"`) = [`{"`, `name`, `":"`]
                                  num_dropped = 1, new_token_ids = [`{"`, `name`, `":"`]

The scheduler drops the last `num_dropped` output tokens (their KV, if computed, is stale), appends
`new_token_ids`, and runs them as an extend step instead of decoding them one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import Grammar

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer


@dataclass(frozen=True)
class Retokenized:
    num_dropped: int  # trailing output tokens to remove
    new_token_ids: list[int]  # tokens that replace them, ending with the forced text


@dataclass(frozen=True)
class JumpForward:
    text: str  # the forced text appended to the output
    num_dropped: int
    new_token_ids: list[int]


def retokenize(
    tokenizer: Tokenizer, output_ids: Sequence[int], forced_text: str
) -> Retokenized | None:
    """The edit that turns `output_ids` into `tokenizer.encode(decode(output_ids) + forced_text)`.

    None when that encoding does not spell the same bytes (e.g. a tokenizer that adds a prefix
    space), so a jump never changes the text.
    """
    token_bytes = tokenizer.vocab_bytes()
    text = tokenizer.decode(output_ids, skip_special_tokens=False)
    full = tokenizer.encode(text + forced_text, add_special_tokens=False)
    keep = 0
    for old, new in zip(output_ids, full):
        if old != new:
            break
        keep += 1
    new_ids = full[keep:]
    before = b"".join(token_bytes[t] for t in output_ids[keep:]) + forced_text.encode("utf-8")
    if not new_ids or b"".join(token_bytes[t] for t in new_ids) != before:
        return None
    return Retokenized(len(output_ids) - keep, new_ids)


def jump_forward(
    grammar: Grammar, tokenizer: Tokenizer, *, min_chars: int = 2
) -> JumpForward | None:
    """Find the forced text after `grammar.token_ids` (the request's output ids), retokenize, and
    advance the grammar over the new ids; None (grammar unchanged) when there is nothing to gain.

    `min_chars`: shorter forced texts are left to sampling (a one-character jump saves no step).
    """
    text = grammar.try_jump_forward()
    if text is None or len(text) < min_chars:
        return None
    edit = retokenize(tokenizer, list(grammar.token_ids), text)
    if edit is None or not grammar.replace_tail(edit.num_dropped, edit.new_token_ids):
        return None
    return JumpForward(text, edit.num_dropped, edit.new_token_ids)
