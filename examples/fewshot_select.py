"""Few-shot sentiment classification with `select`.

A five-shot prefix is the same for every review, so `run_batch` pre-fills it once and every
program then only computes its own review; `select` scores both labels in one prefill-only
call (no tokens are generated at all).

    python examples/fewshot_select.py
"""

from __future__ import annotations

import plait
from plait import assistant, program, select, system, user

SHOTS = [
    ("An absolute joy from start to finish.", "positive"),
    ("I walked out after twenty minutes.", "negative"),
    ("The acting was superb and the story moving.", "positive"),
    ("Dull, predictable and far too long.", "negative"),
    ("I would happily watch it again.", "positive"),
]
REVIEWS = [
    "What a wonderful, heartwarming film. I loved every minute.",
    "Terrible. A boring waste of time and money.",
    "The best movie I have seen this year!",
    "Awful script, bad acting, I hated it.",
]


@program
def classify(s, review):
    s += system("Label each movie review as positive or negative.")
    for text, label in SHOTS:
        s += user(text)
        s += assistant(label)
    s += user(review)
    s += assistant(select("label", ["positive", "negative"]))


def main(backend: plait.Backend | None = None) -> list[str]:
    backend = backend or plait.Runtime()
    states = classify.run_batch([{"review": r} for r in REVIEWS], backend=backend)
    labels = [s["label"] for s in states]
    for review, state in zip(REVIEWS, states):
        scores = state.get_meta_info("label")["scores"]
        print(f"{state['label']:>8}  {scores[0]:6.2f} {scores[1]:6.2f}  {review}")
    return labels


if __name__ == "__main__":
    main()
