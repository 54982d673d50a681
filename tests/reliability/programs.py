"""Programs the fuzzed server registers, so `/programs/{name}` runs real ones."""

from __future__ import annotations

from plait import assistant, gen, program, user


@program
def ask(s, question: str, max_words: int = 4):
    """Answer briefly."""
    s += user(question)
    s += assistant(gen("answer", max_tokens=max(1, min(max_words, 8)), temperature=0))


@program
def fail(s, reason: str = "always"):
    """Raises after one call: its run must be a 500 with the reason, never a crash."""
    s += gen("x", max_tokens=1)
    raise RuntimeError(f"program failed on purpose: {reason}")
