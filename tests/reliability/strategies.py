"""Hypothesis strategies for hostile constraints: regexes with nested quantifiers and huge
{m,n} bounds, deeply nested and recursive JSON schemas."""

from __future__ import annotations

from hypothesis import strategies as st

ATOMS = st.sampled_from(["a", "b", ".", "[ab]", "[^x]", r"\d", r"\w", "[a-z]", "x", "(a|b)"])
QUANTIFIERS = st.sampled_from(["", "*", "+", "?", "{2}", "{0,9}", "{1,300}", "{5000}", "{2,}"])


@st.composite
def regexes(draw: st.DrawFn, depth: int = 0) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        if depth < 6 and draw(st.booleans()):
            inner = draw(regexes(depth=depth + 1))
            atom = f"({inner})" if draw(st.booleans()) else f"(?:{inner}|{draw(ATOMS)})"
        else:
            atom = draw(ATOMS)
        parts.append(atom + draw(QUANTIFIERS))
    return "".join(parts)


def schemas() -> st.SearchStrategy[dict]:
    leaves = st.sampled_from(
        [
            {"type": "string"},
            {"type": "integer"},
            {"type": "boolean"},
            {"type": "string", "maxLength": 5000},
            {"type": "number", "minimum": 0},
            {"enum": ["a", "b"]},
            {"type": "string", "pattern": ".*a.{15}"},
            {"$ref": "#"},
        ]
    )

    def extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        return st.one_of(
            st.builds(lambda c: {"type": "array", "items": c, "maxItems": 3}, children),
            st.builds(
                lambda c: {"type": "object", "properties": {"k": c}, "required": ["k"]}, children
            ),
            st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
        )

    return st.recursive(leaves, extend, max_leaves=60)


# Request bodies: each field absent, plausible, or any JSON value at all (the wrong type, a
# nested object, a huge number), to find a shape the validation lets through to a 500.

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.text(max_size=6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["\ud800", "a\udfffb"]),  # half a surrogate pair: valid JSON, not Unicode
)


def json_values() -> st.SearchStrategy:
    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        return st.lists(children, max_size=3) | st.dictionaries(
            st.text(max_size=4), children, max_size=3
        )

    return st.recursive(SCALARS, extend, max_leaves=6)


def _body(
    fields: dict[str, st.SearchStrategy], required: tuple[str, ...] = ()
) -> st.SearchStrategy[dict]:
    """A body of `fields`, each plausible or hostile; `required` ones are usually present."""
    hostile = json_values()
    optional = {k: st.one_of(v, v, hostile) for k, v in fields.items()}
    always = {k: optional.pop(k) for k in required}
    bodies = st.fixed_dictionaries(always, optional=optional)
    none: st.SearchStrategy[dict] = st.just({})
    stray = st.one_of(
        none, none, none, st.dictionaries(st.text(max_size=5), hostile, min_size=1, max_size=1)
    )
    return st.builds(lambda body, extra: {**extra, **body}, bodies, stray)


_STOP = st.text(min_size=1, max_size=3)
SAMPLING = {
    "min_new_tokens": st.integers(0, 2),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([-1, 1, 5]),
    "min_p": st.floats(0, 1),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "stop": _STOP | st.lists(_STOP, max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=2),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "n": st.integers(1, 2),
    "seed": st.none() | st.integers(0, 100),
    "regex": st.sampled_from([None, "[ab]{1,3}", "(", "\\d+"]),
    "json_schema": st.sampled_from([None, '{"type": "integer"}', "{", '{"type": 5}']),
}


def sampling_params() -> st.SearchStrategy[dict]:
    # NOTE: max_new_tokens is always there (a hostile value at worst) so generation stays short.
    fields = {"max_new_tokens": st.integers(0, 3), **SAMPLING}
    return _body(fields, required=("max_new_tokens",))


_IDS = st.lists(st.integers(0, 1000), max_size=5)


def generate_bodies() -> st.SearchStrategy[dict]:
    """`POST /generate` bodies: usually one of `text` and `input_ids`, sometimes both or none."""
    one = sampling_params()
    text = st.text(max_size=12) | st.lists(st.text(max_size=8), min_size=1, max_size=3)
    ids = _IDS | st.lists(_IDS, min_size=1, max_size=3)
    hostile = json_values()
    prompts = st.one_of(
        st.fixed_dictionaries({"text": text | hostile}),
        st.fixed_dictionaries({"input_ids": ids | hostile}),
        st.fixed_dictionaries({}, optional={"text": text | hostile, "input_ids": ids | hostile}),
    )
    fields = {
        "sampling_params": one | st.lists(one, max_size=3),
        "return_logprob": st.booleans(),
        "logprob_start_len": st.integers(-1, 3),
        "top_logprobs_num": st.integers(0, 3),
        "return_text_in_logprobs": st.booleans(),
        "stream": st.booleans(),
        "rid": st.uuids().map(str) | st.lists(st.uuids().map(str), min_size=1, max_size=3),
        "timeout": st.floats(0.5, 5),
    }
    rest = _body(fields, required=("sampling_params",))
    return st.builds(lambda prompt, body: {**body, **prompt}, prompts, rest)


_OPENAI = {
    "model": st.just("m"),
    "n": st.integers(1, 2),
    "stop": _STOP | st.lists(_STOP, max_size=2),
    "seed": st.integers(0, 100),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([-1, 1, 5]),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=2),
    "user": st.text(max_size=4),
    "timeout": st.floats(0.5, 5),
}


def completion_bodies() -> st.SearchStrategy[dict]:
    """`POST /v1/completions` bodies."""
    fields = {
        "prompt": st.text(max_size=12)
        | st.lists(st.text(max_size=8), min_size=1, max_size=2)
        | _IDS
        | st.lists(_IDS, min_size=1, max_size=2),
        "max_tokens": st.integers(0, 3),
        "logprobs": st.integers(0, 2),
        "echo": st.booleans(),
        "json_schema": st.sampled_from([None, '{"type": "integer"}', {"type": "boolean"}]),
        **_OPENAI,
    }
    return _body(fields, required=("prompt", "max_tokens"))


def chat_bodies() -> st.SearchStrategy[dict]:
    """`POST /v1/chat/completions` bodies."""
    role = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
    content = st.text(max_size=8) | st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=4)}), max_size=2
    )
    message = _body({"role": role, "content": content}, required=("role",))
    tool = st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": _body(
                {
                    "name": st.sampled_from(["f", "get_weather"]),
                    "parameters": st.just(
                        {"type": "object", "properties": {"x": {"type": "integer"}}}
                    ),
                },
                required=("name",),
            ),
        }
    )
    fields = {
        "messages": st.lists(message, min_size=1, max_size=3),
        "max_tokens": st.integers(0, 3),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 2),
        "response_format": st.sampled_from(
            [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}]
        ),
        "tools": st.lists(tool, max_size=2),
        "tool_choice": st.sampled_from(["none", "auto", "required"]),
        **_OPENAI,
    }
    return _body(fields, required=("messages", "max_tokens"))
