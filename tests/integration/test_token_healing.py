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
        "The capital of France is ",
        {"max_new_tokens": 8, "temperature": 0, "token_healing": True, "regex": "Paris"},
    )
    assert out["text"] == "Paris"
    ids = [t for t in out["output_ids"] if t not in tok.eos_token_ids]
    assert ids == tok.encode(
        " Paris", add_special_tokens=False
    )  # one merged token, not " " + "Paris"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = tiny_engine.generate(
        "JSON: ",
        {
            "max_new_tokens": 16,
            "temperature": 0,
            "token_healing": True,
            "json_schema": json.dumps(schema),
        },
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
    direct = tiny_engine.generate(
        prompt, {"max_new_tokens": 4, "temperature": 0, "token_healing": True}
    )
    assert healed["answer"] == direct["text"]
    assert healed.text() == prompt + direct["text"]
    capital.run(country="France", backend=rt, token_healing=False)
    assert "token_healing" not in sent[-1]


CHAT_PROMPT = "<|im_start|>user\nName one idea.<|im_end|>\n<|im_start|>assistant\n"


def _healed_generate(engine, prompt: str, **params) -> dict:
    out = engine.generate(prompt, {"temperature": 0, "token_healing": True, **params})
    assert out["meta_info"]["healed_text"] == prompt[-1]
    return out


def test_stop_strings_match_only_after_the_healed_text(tiny_engine):
    """The role header's trailing newline is healed: the regenerated newline is the prompt's,
    so `stop="\\n"` ends the output at the first newline after it, never on it."""
    free = _healed_generate(tiny_engine, CHAT_PROMPT, max_new_tokens=24, ignore_eos=True)
    stopped = _healed_generate(
        tiny_engine, CHAT_PROMPT, max_new_tokens=24, ignore_eos=True, stop=["\n"]
    )
    assert stopped["text"] == free["text"].split("\n")[0]
    if "\n" in free["text"]:
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\n"}


def test_tokens_that_rewrite_the_healed_text_are_not_counted(tiny_engine):
    """A first token that only rewrites the healed text is the prompt's: `max_new_tokens` new
    tokens follow it, and `completion_tokens` counts those."""
    tok = tiny_engine.tokenizer
    out = _healed_generate(tiny_engine, CHAT_PROMPT, max_new_tokens=8, ignore_eos=True)
    ids = out["output_ids"]
    rewrites = int(tok.token_bytes(ids[0]) == b"\n")
    assert out["meta_info"]["completion_tokens"] == 8
    assert len(ids) == 8 + rewrites
    assert out["text"] == tok.decode(ids)[1:]


@program
def chat_idea(s):
    s += "<|im_start|>user\nName one idea.<|im_end|>\n<|im_start|>assistant\n"
    s += gen("idea", stop="\n", max_tokens=24, temperature=0, ignore_eos=True)


def test_a_program_gen_after_a_role_header_stops_after_the_header(tiny_engine):
    free = _healed_generate(tiny_engine, CHAT_PROMPT, max_new_tokens=24, ignore_eos=True)
    state = chat_idea.run(backend=Runtime(engine=tiny_engine))
    assert state["idea"] == free["text"].split("\n")[0]


def test_generate_heals_without_stopping_on_the_healed_text(tiny_llama_dir):
    import httpx

    from tests.integration.server_support import tiny_server

    with (
        tiny_server(tiny_llama_dir) as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "token_healing": True}
        free = http.post("/generate", json={"text": CHAT_PROMPT, "sampling_params": params}).json()
        stop = {**params, "stop": ["\n"]}
        out = http.post("/generate", json={"text": CHAT_PROMPT, "sampling_params": stop}).json()
    assert out["meta_info"]["healed_text"] == "\n"
    assert out["text"] == free["text"].split("\n")[0]
    assert free["meta_info"]["completion_tokens"] == 24
