"""Token healing: where a prompt's fixed text meets generated text, the prompt's last token may be
the start of a longer token the model would have used had it written both sides itself (a prompt
ending in "Answer: " leaves the model to start a word without its space, a token it rarely saw).
The prompt is backed up over that token, and the output is constrained to begin with its text,
so the model picks the merged token itself; the removed text is then cut from what is returned.

    prompt "... A: "  ->  prompt "... A:", output constrained to " (?s:.*)"  ->  " Paris" -> "Paris"
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer


@dataclass(frozen=True)
class Healing:
    prompt_ids: list[int]  # the prompt without its last token
    text: str  # what that token spelled: the output must start with it


class TokenHealer:
    """Decides, per last prompt token, whether to back up over it (cached per token id)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = tokenizer.vocab_bytes()
        self.excluded = tokenizer.special_token_ids | tokenizer.eos_token_ids
        self._extends: dict[int, bool] = {}

    def heal(self, prompt_ids: Sequence[int]) -> Healing | None:
        """The backed-up prompt, or None when the last token cannot merge with what follows (a
        special token, a token no longer token starts with, or a one-token prompt)."""
        if len(prompt_ids) < 2:
            return None
        last = prompt_ids[-1]
        if last in self.excluded or last >= len(self.token_bytes) or not self._is_extended(last):
            return None
        try:
            text = self.token_bytes[last].decode("utf-8")
        except UnicodeDecodeError:
            return None
        return Healing(list(prompt_ids[:-1]), text)

    def _is_extended(self, token_id: int) -> bool:
        found = self._extends.get(token_id)
        if found is None:
            spelled = self.token_bytes[token_id]
            found = bool(spelled) and any(
                len(other) > len(spelled) and other.startswith(spelled)
                for i, other in enumerate(self.token_bytes)
                if i not in self.excluded
            )
            self._extends[token_id] = found
        return found
