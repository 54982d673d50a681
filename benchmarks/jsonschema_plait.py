"""plait's runs of `plait bench jsonschema` on one engine (one grammar backend): the backend's first
compile (`warm_up`), each schema's compile (`compile_all`), the time to fill a token mask along a
short random walk of a compiled grammar (`mask_times`), greedy generation of an instance of each
schema with its output sorted into valid, finished-but-invalid, truncated, closed early
(`generate_all`, `classify`), and constrained against free decode speed (`decode_speed` on
`SPEED_SCHEMAS`). The prompt is the user message llama.cpp's runs send too (`user_message`).
"""

from __future__ import annotations

import json
import time
from typing import Any

MAX_PROMPT_SCHEMA_CHARS = 6000  # longer schemas are not repeated in the prompt


def warm_up(engine: Any) -> float:
    """Seconds of the backend's first compile (a one-token regex), which builds its per-tokenizer
    state once; timed apart, so that the schemas' compile times are each schema's own."""
    from plait.runtime.constrained import make_grammar_key

    start = time.perf_counter()
    engine._grammar_cache().get(make_grammar_key(regex="[0-9]"))
    return time.perf_counter() - start


def compile_all(engine: Any, schemas: list[tuple[str, str, Any]], timeout: float) -> list[Any]:
    """The compiled grammar of each schema, or the error string; with compile seconds."""
    from plait.runtime.constrained import GrammarError, make_grammar_key

    cache = engine._grammar_cache()
    results = []
    for _, _, schema in schemas:
        start = time.perf_counter()
        try:
            key = make_grammar_key(
                json_schema=schema, json_whitespace=engine.config.json_whitespace
            )
            compiled: Any = cache.get(key, timeout=timeout)
        except (GrammarError, TimeoutError) as e:
            compiled = f"{type(e).__name__}: {e}"[:200]
        except Exception as e:  # a backend crash counts against coverage, not the run
            compiled = f"crash {type(e).__name__}: {e}"[:200]
        results.append((compiled, time.perf_counter() - start))
    return results


def mask_times(engine: Any, compiled: Any, steps: int = 24) -> list[float]:
    import numpy as np

    from plait.kernels.constraint_mask import allocate_token_bitmask

    rng = np.random.default_rng(0)
    grammar = compiled.new_grammar()
    bitmask = allocate_token_bitmask(1, engine.args.vocab_size)
    eos = engine.tokenizer.eos_token_ids
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        grammar.fill_bitmask(bitmask, 0)
        times.append(time.perf_counter() - start)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
        allowed = [t for t in np.flatnonzero(bits).tolist() if t not in eos]
        if not allowed or not grammar.try_advance(int(rng.choice(allowed))):
            break
    return times


def user_message(schema: Any) -> str:
    text = json.dumps(schema)
    ask = "Generate a JSON object that is a valid instance of this JSON schema."
    return f"{ask}\n\n{text}" if len(text) <= MAX_PROMPT_SCHEMA_CHARS else ask


def prompt_for(tokenizer: Any, schema: Any) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message(schema)}], add_generation_prompt=True
    )


def classify(out: dict, schema: Any) -> str:
    import jsonschema

    meta = out["meta_info"]
    finished = meta["finish_reason"]["type"] == "stop"
    closed = bool(meta.get("closed_early"))
    try:
        value = json.loads(out["text"])
        cls = jsonschema.validators.validator_for(schema)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    except Exception:  # the validator itself cannot read the schema (remote $ref, ...)
        return "unvalidated"
    if closed:
        return "closed_valid" if valid else "closed_invalid"
    if valid:
        return "valid"
    return "finished_invalid" if finished else "truncated"


def _generate_one(engine: Any, prompt: str, params: dict) -> dict:
    """One request; a refusal (the budget below the schema's shortest instance, as the server's
    400 says) becomes an empty output marked `refused`."""
    from plait.runtime.constrained import GrammarError

    try:
        return engine.generate(prompt, params)
    except GrammarError as e:
        return {
            "text": "",
            "meta_info": {
                "refused": str(e),
                "completion_tokens": 0,
                "finish_reason": {"type": "abort", "message": str(e)},
            },
        }


def generate_all(
    engine: Any, items: list[tuple[Any, Any]], max_tokens: int
) -> tuple[list[str], float, int]:
    prompts = [prompt_for(engine.tokenizer, schema) for schema, _ in items]
    params = [
        {"max_new_tokens": max_tokens, "temperature": 0, "json_schema": json.dumps(schema)}
        for schema, _ in items
    ]
    from plait.runtime.constrained import GrammarError

    start = time.perf_counter()
    try:
        outs = engine.generate(prompts, params)
    except GrammarError:  # a schema's shortest instance is longer than the budget: each alone
        outs = [_generate_one(engine, prompt, p) for prompt, p in zip(prompts, params)]
    seconds = time.perf_counter() - start
    kinds = [
        "budget_refused" if o["meta_info"].get("refused") else classify(o, schema)
        for o, (schema, _) in zip(outs, items)
    ]
    for out, kind in zip(outs, kinds):  # each schema's outcome, for the JSON report
        out["kind"] = kind
    return kinds, seconds, sum(o["meta_info"]["completion_tokens"] for o in outs), outs


# Schemas whose instances are long, for constrained against free decode speed.
# NOTE: minItems small enough for the outlines automaton (it unrolls the repetition)
SPEED_SCHEMAS = {
    # length-bounded strings: llguidance's masks cost more here than for unbounded strings
    "strings": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 8},
    # records: forced keys (jump-forward), free strings and numbers
    "records": {
        "type": "array",
        "minItems": 4,
        "items": {
            "type": "object",
            "required": ["name", "color", "price"],
            "properties": {
                "name": {"type": "string"},
                "color": {"type": "string"},
                "price": {"type": "number"},
            },
        },
    },
}


def decode_speed(
    engine: Any, batch: int, tokens: int, schema: Any = SPEED_SCHEMAS["strings"]
) -> dict[str, float]:
    """Output tok/s of `batch` requests of up to `tokens` tokens each, free and under `schema`;
    each counts the tokens it wrote."""
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List many fruits, with their color and price."}],
        add_generation_prompt=True,
    )
    out = {}
    for name, extra in (
        ("free", {"ignore_eos": True}),
        ("constrained", {"json_schema": json.dumps(schema), "budget_closing": False}),
    ):
        params = {"max_new_tokens": tokens, "temperature": 0, **extra}
        engine.generate([prompt] * batch, [params] * batch)  # warm up, compile
        start = time.perf_counter()
        outs = engine.generate([prompt] * batch, [params] * batch)
        n = sum(o["meta_info"]["completion_tokens"] for o in outs)
        out[name] = n / (time.perf_counter() - start)
    return out
