"""Tree of thought with nested `fork`: plans, then checks of each plan, then a choice.

Every branch continues from the same text, so the engine computes the shared prefix once and
decodes all branches of a level in one batch.

    python examples/tree_of_thought.py
"""

from __future__ import annotations

import plait
from plait import gen, program, select, system, user

QUESTION = "A farmer has 3 fields with 12 cows each. He sells 10 cows. How many are left?"


@program
def tree_of_thought(s, question, width=2):
    s += system("You solve problems step by step.")
    s += user(question)
    with s.assistant():
        s += "Let me try different approaches.\n"
        plans = s.fork(width)
        for i, plan in enumerate(plans):  # submitted together: the plans decode as one batch
            plan += f"Approach {i + 1}:" + gen(
                "plan", max_tokens=16, min_tokens=3, stop="\n", temperature=0.7
            )
        checks = [plan.fork(width) for plan in plans]  # waits for each plan's text
        for group in checks:
            group += "\nCheck:" + gen(
                "check", max_tokens=10, min_tokens=3, stop="\n", temperature=0.7
            )
        for group in checks:
            group.join()
        plans.join()
        for i, plan in enumerate(s["plan"]):
            s += f"Approach {i + 1}: {plan.strip()}\n"
        s += "The best approach is" + select("best", [f" {i + 1}" for i in range(width)])
        s += ". Answer:" + gen("answer", max_tokens=12, stop="\n", temperature=0)


def main(backend: plait.Backend | None = None) -> plait.ProgramState:
    backend = backend or plait.Runtime()
    state = tree_of_thought.run(question=QUESTION, backend=backend)
    for plan, checks in zip(state["plan"], state["check"]):
        print(f"plan: {plan.strip()}\n  checks: {[c.strip() for c in checks]}")
    print(f"best approach:{state['best']}; answer:{state['answer']}")
    return state


if __name__ == "__main__":
    main()
