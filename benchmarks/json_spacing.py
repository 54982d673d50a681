"""`plait bench json`, the spacing part: how JSON's whitespace (`json_whitespace`) changes what a
model extracts and how fast.

Twelve short paragraphs about people, each with a name, an age and a city; the model extracts
`{name, age, city}` under a schema, greedy, once per spacing, and the answers are checked against
the facts in the paragraphs. Speed: the benchmark's 8-field extraction requests under each spacing,
jump-forward on and off.
"""

from __future__ import annotations

import json
import time
from typing import Any

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

# (name, age, city, the paragraph that says so)
PEOPLE = [
    ("Maria Lopez", 34, "Madrid", "Maria Lopez is a 34-year-old architect who lives in Madrid."),
    (
        "Tom Becker",
        52,
        "Hamburg",
        "At 52, Tom Becker still runs the bakery his father opened in Hamburg.",
    ),
    ("Aiko Tanaka", 27, "Kyoto", "Aiko Tanaka, 27, teaches piano in Kyoto on weekday evenings."),
    (
        "Samuel Okoro",
        41,
        "Lagos",
        "Samuel Okoro moved to Lagos ten years ago; he turned 41 this spring.",
    ),
    ("Lena Novak", 19, "Prague", "Lena Novak is a 19-year-old student of chemistry in Prague."),
    (
        "Carlos Mendes",
        63,
        "Lisbon",
        "Retired sailor Carlos Mendes (63) spends his mornings by the river in Lisbon.",
    ),
    (
        "Priya Sharma",
        30,
        "Pune",
        "Priya Sharma, who is 30, writes software for a hospital in Pune.",
    ),
    ("Jonas Berg", 45, "Oslo", "Jonas Berg lives in Oslo with his two dogs. He is 45 years old."),
    ("Fatima Haddad", 38, "Beirut", "Fatima Haddad is 38 and works as a translator in Beirut."),
    (
        "Owen Price",
        23,
        "Cardiff",
        "Owen Price, a 23-year-old rugby coach, was born and raised in Cardiff.",
    ),
    (
        "Elena Rossi",
        57,
        "Turin",
        "In Turin, Elena Rossi (57) repairs old clocks in a shop near the station.",
    ),
    ("Mateo Silva", 12, "Quito", "Mateo Silva is 12 years old and goes to school in Quito."),
]


def extraction_prompts(tokenizer: Any) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Extract the person's name, age and city as JSON.\n\n{text}",
                }
            ]
        )
        for _, _, _, text in PEOPLE
    ]


def accuracy(engine: Any, spacing: str) -> dict[str, Any]:
    """The extraction under one spacing: how many names, ages and cities came out right."""
    params = {
        "max_new_tokens": 64,
        "temperature": 0,
        "json_schema": json.dumps(PERSON),
        "json_whitespace": spacing,
    }
    start = time.perf_counter()
    outs = engine.generate(extraction_prompts(engine.tokenizer), [params] * len(PEOPLE))
    seconds = time.perf_counter() - start
    right = {"names_right": 0, "ages_right": 0, "cities_right": 0}
    for (name, age, city, _), out in zip(PEOPLE, outs):
        try:
            got = json.loads(out["text"])
        except ValueError:
            continue
        right["names_right"] += str(got.get("name", "")).strip().lower() == name.lower()
        right["ages_right"] += got.get("age") == age
        right["cities_right"] += str(got.get("city", "")).strip().lower() == city.lower()
    return {
        "of": len(PEOPLE),
        **right,
        "seconds": seconds,
        "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        "sample": outs[0]["text"],
    }


def spacing_rows(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for spacing, r in results.items():
        a = r["accuracy"]
        rows.append(
            [
                spacing,
                f"{a['ages_right']}/{a['of']}",
                f"{a['names_right']}/{a['of']}",
                f"{a['cities_right']}/{a['of']}",
                r["jf_off_s"],
                r["jf_on_s"],
                r["jf_off_s"] / r["jf_on_s"],
                f"{r['jumped']}/{r['output_tokens']}",
            ]
        )
    return rows


SPACING_HEADERS = [
    "spacing",
    "ages right",
    "names right",
    "cities right",
    "JF off s",
    "JF on s",
    "JF speedup",
    "jumped/output",
]
