"""Token healing through the Engine and programs: the prompt backs up over a last token that
could merge, the output starts with its text (cut from what is returned), constraints still hold,
and the ids across the boundary are the tokenizer's own."""

from __future__ import annotations

import json

from plait.interpreter.backends.local import Runtime
from plait.lang import gen, program
from plait.runtime.constrained.healing import TokenHealer


def test_which_prompts_are_healed(smollm_tokenizer):
    tok = smollm_tokenizer
    healer = TokenHealer(tok)
    ids = tok.encode("Q: the capital?\nA: ", add_special_tokens=False)
    healing = healer.heal(ids)
    assert healing is not None and healing.text == " " and healing.prompt_ids == ids[:-1]
    assert healer.heal(tok.encode("<|im_start|>", add_special_tokens=False) * 2) is None  # special
    assert healer.heal(ids[-1:]) is None  # a one-token prompt stays


def test_healed_output_starts_with_the_merged_token(tiny_engine):
    tok = tiny_engine.tokenizer
    prompt = "Q: the capital of France?\nA: "
    params = {"max_new_tokens": 6, "temperature": 0, "token_healing": True}
    out = tiny_engine.generate(prompt, params)
    meta = out["meta_info"]
    assert meta["healed_text"] == " "
    assert meta["prompt_tokens"] == len(tok.encode(prompt)) - 1
    first = tok.token_bytes(out["output_ids"][0])
    assert first.startswith(b" ")
    whole = tok.decode(out["output_ids"])
    assert out["text"] == whole[1:]  # the healed space belongs to the prompt
    plain = tiny_engine.generate(prompt, {**params, "token_healing": False})
    assert "healed_text" not in plain["meta_info"]


def test_healing_with_a_constraint_gives_the_tokenizers_ids(tiny_engine):
    tok = tiny_engine.tokenizer
    out = tiny_engine.generate(
        "The capital of France is ", {"max_new_tokens": 8, "temperature": 0, "token_healing": True, "regex": "Paris"}
    )
    assert out["text"] == "Paris"
    ids = [t for t in out["output_ids"] if t not in tok.eos_token_ids]
    assert ids == tok.encode(" Paris", add_special_tokens=False)  # one merged token, not " " + "Paris"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = tiny_engine.generate(
        "JSON: ", {"max_new_tokens": 16, "temperature": 0, "token_healing": True, "json_schema": json.dumps(schema)}
    )
    assert isinstance(json.loads(out["text"])["a"], int)


@program
def capital(s, country: str):
    s += f"Q: What is the capital of {country}?\nA: " + gen("answer", max_tokens=4, temperature=0)


def test_programs_heal_by_default(tiny_engine):
    sent = []

    class Recording(Runtime):
        def generate(self, text, sampling_params, **kwargs):
            sent.append(sampling_params)
            return super().generate(text, sampling_params, **kwargs)

    rt = Recording(engine=tiny_engine)
    healed = capital.run(country="France", backend=rt)
    assert sent[-1]["token_healing"] is True
    prompt = "Q: What is the capital of France?\nA: "
    direct = tiny_engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0, "token_healing": True})
    assert healed["answer"] == direct["text"]
    assert healed.text() == prompt + direct["text"]
    capital.run(country="France", backend=rt, token_healing=False)
    assert "token_healing" not in sent[-1]
