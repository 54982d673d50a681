"""Scoring `select` choices with one batched, prefill-only model call.

Each choice is sent as `prompt + choice` with `max_new_tokens: 0` and input logprobs from two
tokens before the prompt's end (as SGLang's frontend does: a choice may merge with the
prompt's last token, and the first returned entry has no logprob). The entries whose text
reaches past the prompt are the choice's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait.interpreter.errors import GenerationError
from plait.lang.ir import SELECT_METHODS

Entry = list[Any]  # [logprob | None, token_id, token_text | None]


@dataclass(frozen=True)
class SelectResult:
    choices: tuple[str, ...]
    index: int
    method: str
    scores: list[float]  # what the method maximized, per choice
    normalized_prompt_logprobs: list[float]  # mean logprob of each choice's tokens
    token_logprobs: list[list[Entry]]  # each choice's scored entries
    unconditional_token_logprobs: list[list[Entry]] | None = None

    @property
    def choice(self) -> str:
        return self.choices[self.index]

    def meta_info(self) -> dict[str, Any]:
        return {
            "choices": list(self.choices),
            "method": self.method,
            "scores": self.scores,
            "normalized_prompt_logprobs": self.normalized_prompt_logprobs,
            "input_token_logprobs": self.token_logprobs,
            "unconditional_token_logprobs": self.unconditional_token_logprobs,
        }


def score_choices(
    backend: Any, prompt: str, choices: tuple[str, ...], method: str, rids: list[str]
) -> SelectResult:
    if method not in SELECT_METHODS:
        raise ValueError(f"select: unknown method {method!r}")
    start = max(backend.count_prompt_tokens(prompt, rid=f"{rids[0]}-n") - 2, 0) if prompt else 0
    outs = _prefill(backend, [prompt + c for c in choices], start, rids)
    entries = [
        choice_entries(o["meta_info"]["input_token_logprobs"], c) for o, c in zip(outs, choices)
    ]
    logprobs = [[e[0] for e in es if e[0] is not None] for es in entries]
    means = [_mean(lp) for lp in logprobs]
    unconditional = None
    if method == "token_length_normalized":
        scores = means
    elif method == "greedy_token":
        scores = greedy_ranks(logprobs)
    else:
        uncond_outs = _prefill(backend, list(choices), 0, [f"{r}-u" for r in rids])
        unconditional = [o["meta_info"]["input_token_logprobs"] for o in uncond_outs]
        scores = [
            m - _mean([e[0] for e in u if e[0] is not None]) for m, u in zip(means, unconditional)
        ]
    best = max(range(len(choices)), key=lambda i: (scores[i], -i))
    return SelectResult(tuple(choices), best, method, scores, means, entries, unconditional)


def _prefill(backend: Any, texts: list[str], start: int, rids: list[str]) -> list[dict[str, Any]]:
    outs = backend.generate(
        texts,
        {"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=start,
        return_text_in_logprobs=True,
        rid=rids,
    )
    for o in outs:
        reason = o["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise GenerationError(f"select: the backend aborted scoring: {reason.get('message')}")
    return outs


def choice_entries(entries: list[Entry], choice: str) -> list[Entry]:
    """The entries of `choice`'s tokens: those whose text extends past the prompt."""
    texts = [e[2] or "" for e in entries]
    joined = "".join(texts)
    if not choice or not joined.endswith(choice):
        # NOTE: token texts that do not concatenate to the input (partial UTF-8, no text
        # returned): fall back to every entry after the first, which is the prompt's.
        return entries[1:]
    boundary, end, out = len(joined) - len(choice), 0, []
    for entry, text in zip(entries, texts):
        end += len(text)
        if end > boundary:
            out.append(entry)
    return out


def greedy_ranks(logprobs: list[list[float]]) -> list[float]:
    """`greedy_token`: the best first token wins; ties go to the next token, and so on (a
    shorter choice is padded with its own mean). The winner scores 1, the others 0."""
    width = max((len(lp) for lp in logprobs), default=0)
    rows = [lp + [_mean(lp)] * (width - len(lp)) for lp in logprobs]
    remaining = list(range(len(rows)))
    for j in range(width):
        top = max(rows[i][j] for i in remaining)
        remaining = [i for i in remaining if rows[i][j] == top]
        if len(remaining) == 1:
            break
    return [1.0 if i == remaining[0] else 0.0 for i in range(len(rows))]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
