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
    leaves = st.sampled_from([
        {"type": "string"}, {"type": "integer"}, {"type": "boolean"},
        {"type": "string", "maxLength": 5000}, {"type": "number", "minimum": 0},
        {"enum": ["a", "b"]}, {"type": "string", "pattern": ".*a.{15}"},
        {"$ref": "#"},
    ])  # fmt: skip

    def extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        return st.one_of(
            st.builds(lambda c: {"type": "array", "items": c, "maxItems": 3}, children),
            st.builds(lambda c: {"type": "object", "properties": {"k": c}, "required": ["k"]},
                      children),  # fmt: skip
            st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
        )

    return st.recursive(leaves, extend, max_leaves=60)
