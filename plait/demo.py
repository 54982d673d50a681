"""`python -m plait.demo` (for `make demo`): starts `plait serve` on the embedded model,
runs a plait program against it through `plait.Endpoint` and an `openai` chat call with a JSON
schema, prints both, and stops the server."""

from __future__ import annotations

import json
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def main() -> int:
    import openai

    import plait
    from plait import assistant, gen, program, system, user
    from plait.server.launch import ServerProcess

    @program
    def tip(s, topic):
        s += system("You give one short, practical tip.")
        s += user(f"One tip about {topic}.")
        s += assistant(gen("tip", max_tokens=48, temperature=0, stop=["\n\n"]))

    start = time.perf_counter()
    with ServerProcess(["--log-level", "warning", "--max-total-tokens", "16384"]) as server:
        print(f"plait serve is up at {server.url} after {time.perf_counter() - start:.1f}s\n")
        endpoint = plait.Endpoint(server.url)
        states = tip.run_batch(
            [{"topic": t} for t in ("writing clear code", "sleep")], backend=endpoint
        )
        print("program `tip` through plait.Endpoint:")
        for state in states:
            print(f"  - {state['tip'].strip()}")

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Maria Garcia, 34, lives in Lisbon. As JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            },
            max_tokens=64,
            temperature=0,
        )
        person = json.loads(reply.choices[0].message.content)
        print(f"\nopenai client, JSON schema: {person}")
        print(f"usage: {reply.usage.model_dump(exclude_none=True)}")
    print("\nserver stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
