"""Local JSON pointers (`#/definitions/a`), as `$ref`s spell them and as the schema walks name
the places they visit: one canonical spelling, and the node a pointer names."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

MISSING = object()  # what `resolve` returns for a pointer into nothing


def escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def local_pointer(ref: str) -> str | None:
    """`ref` in canonical form (`#`, or `#/a/b` with each token escaped once); None for another
    document or an anchor name."""
    if ref in ("#", "#/"):
        return "#"
    if not ref.startswith("#/"):
        return None
    tokens = [unquote(t).replace("~1", "/").replace("~0", "~") for t in ref[2:].split("/")]
    return "#" + "".join("/" + escape(t) for t in tokens)


def resolve(root: Any, pointer: str) -> Any:
    """The node a canonical `pointer` names in `root`, or `MISSING`."""
    node = root
    if pointer == "#":
        return node
    for token in pointer[2:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return MISSING
    return node
