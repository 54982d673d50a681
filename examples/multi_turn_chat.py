"""A multi-turn chat: each turn re-sends the conversation, and the engine's prefix cache reuses
the earlier turns (see `cached_tokens`). The last reply is streamed.

    python examples/multi_turn_chat.py
"""

from __future__ import annotations

import plait
from plait import assistant, gen, program, system, user

TURNS = ["Hi! What is a good name for a cat?", "Why that name?", "Give me one more."]


@program
def chat(s, turns):
    s += system("You are a friendly assistant. Answer in one short sentence.")
    for i, turn in enumerate(turns):
        s += user(turn)
        s += assistant(gen(f"reply{i}", max_tokens=24, temperature=0))


def main(backend: plait.Backend | None = None) -> plait.ProgramState:
    backend = backend or plait.Runtime()
    state = chat.run(turns=TURNS, backend=backend, stream=True)
    for i, turn in enumerate(TURNS):
        print(f"user: {turn}\nassistant: ", end="", flush=True)
        for chunk in state.text_iter(f"reply{i}"):
            print(chunk, end="", flush=True)
        cached = state.get_meta_info(f"reply{i}")["cached_tokens"]
        print(f"\n  ({cached} prompt tokens were cached)")
    return state


if __name__ == "__main__":
    main()
