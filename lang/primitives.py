"""The primitives a program appends: `gen`, `select`, roles; `fork` / `join` helpers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from plait.lang.constraints import Constraint
from plait.lang.ir import Gen, Node, Role, Select, as_node
from plait.lang.sampling import SamplingSpec
from plait.lang.tools import tool_specs


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    choices: Sequence[str] | None = None,
    dtype: type | None = None,
    *,
    grammar: str | None = None,
    min_tokens: int | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    token_healing: bool | None = None,
    json_whitespace: str | None = None,
    tools: Sequence[Callable[..., Any]] | None = None,
    max_tool_calls: int = 4,
    choices_method: str = "token_length_normalized",
) -> Node:
    """Generate into variable `name`. Unset sampling fields come from `run(...)` or the backend.

    `json_schema` may be a dict, a JSON string or a pydantic model (then `state[name]` is an
    instance of it); `dtype` is int, float, bool or str; `grammar` is a context-free grammar
    (GBNF / EBNF `root ::= ...`, or Lark); `choices` makes this a `select`. `token_healing`
    (on by default where the backend has it) lets the first token merge with the prompt's last.
    `json_whitespace` spaces JSON under a schema: "conventional" (`{"a": 1, "b": 2}`, the
    backend's default), "compact" (`{"a":1,"b":2}`) or "flexible" (the model's own).
    """
    _check_name(name)
    if choices is not None:
        others = [
            n
            for n, v in (
                ("regex", regex),
                ("json_schema", json_schema),
                ("dtype", dtype),
                ("grammar", grammar),
                ("tools", tools),
            )
            if v
        ]
        if others:
            raise ValueError(f"gen: choices cannot be combined with {', '.join(others)}")
        return Select(name, tuple(choices), choices_method)
    sampling = SamplingSpec(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
        ignore_eos=ignore_eos,
        seed=seed,
        token_healing=token_healing,
        json_whitespace=json_whitespace,
    )
    constraint = Constraint.build(
        regex=regex, json_schema=json_schema, dtype=dtype, grammar=grammar
    )
    if tools:
        if constraint is not None:
            raise ValueError(
                "gen: tools cannot be combined with regex, json_schema, dtype or grammar"
            )
        if not isinstance(max_tool_calls, int) or max_tool_calls < 0:
            raise ValueError(
                f"max_tool_calls: expected a non-negative integer, got {max_tool_calls!r}"
            )
        return Gen(name, sampling, None, tuple(tool_specs(tools)), max_tool_calls)
    return Gen(name, sampling, constraint)


def gen_int(name: str | None = None, **kwargs: Any) -> Node:
    """`gen(name, dtype=int, ...)`: `state[name]` is an int."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Node:
    """`gen(name, dtype=str, ...)`: a JSON-quoted string, read back without its quotes."""
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    method: str = "token_length_normalized",
) -> Select:
    """Append the choice the model finds most likely; all choices are scored in one call.

    Methods: `token_length_normalized` (mean token logprob), `greedy_token` (best first token,
    ties broken by the next), `unconditional_likelihood_normalized` (mean logprob minus the
    choice's mean logprob without the program's context).
    """
    _check_name(name)
    if choices is None or isinstance(choices, str):
        raise ValueError(f"select: choices must be a list of strings, got {choices!r}")
    return Select(name, tuple(choices), method)


def role(name: str, *content: object) -> Role:
    """A whole message of role `name`; `content` is strings and nodes (e.g. `gen(...)`)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"role: expected a non-empty role name, got {name!r}")
    if not content:
        raise ValueError(f"{name}: give the message content, or use `with s.{name}(): ...`")
    return Role(name, tuple(as_node(c) for c in content))


def system(*content: object) -> Role:
    return role("system", *content)


def user(*content: object) -> Role:
    return role("user", *content)


def assistant(*content: object) -> Role:
    return role("assistant", *content)


def fork(state: Any, n: int) -> Any:
    """`state.fork(n)`: n branches that continue from the state's current text."""
    return state.fork(n)


def join(forks: Any, mode: str = "gather_variable") -> None:
    """`forks.join(mode)`: bring the branches' variables (or text, mode="concat") back."""
    forks.join(mode)


def _check_name(name: object) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"variable name: expected a non-empty string or None, got {name!r}")
