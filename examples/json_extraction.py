"""Extract structured data into a pydantic model.

`gen(json_schema=Person)` constrains decoding to the model's JSON schema, and `state["person"]`
comes back as a `Person` instance (the raw JSON stays in `state.var_text("person")`).

    python examples/json_extraction.py
"""

from __future__ import annotations

from pydantic import BaseModel

import plait
from plait import assistant, gen, program, system, user

TEXTS = [
    "Maria Garcia is a 34-year-old architect who lives in Lisbon.",
    "Born 52 years ago, Tom Becker runs a bakery in Hamburg.",
]


class Person(BaseModel):
    name: str
    age: int
    city: str


@program
def extract(s, text):
    s += system("Extract the person described by the user as JSON.")
    s += user(text)
    s += assistant(gen("person", json_schema=Person, max_tokens=48, temperature=0))


def main(backend: plait.Backend | None = None) -> list[Person]:
    backend = backend or plait.Runtime()
    people = []
    for state in extract.run_batch([{"text": t} for t in TEXTS], backend=backend):
        person = state["person"]
        print(repr(person))
        people.append(person)
    return people


if __name__ == "__main__":
    main()
