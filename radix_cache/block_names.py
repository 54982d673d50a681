"""Content addresses of KV pages: a hash chain over token ids, seeded by what makes KV reusable.

A page's name is `H(name of the page before it, the page's token ids)`, and the first page chains
from `root_name(salt)`, where the salt fingerprints everything besides the tokens that decides the
page's keys and values (the weights, the KV dtype, the page size, ...). Two pages with the same
name hold the same KV whichever process or tier computed them, so a name is a key any tier can
store a page under; a name says nothing about a page whose salt differs.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

NAME_BYTES = 16


def root_name(salt: bytes) -> bytes:
    """The name the first page of every prefix chains from."""
    return hashlib.blake2b(salt, digest_size=NAME_BYTES, person=b"plait-kv-root").digest()


def chain_names(parent: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The names of the whole pages of `tokens`, the first chained from `parent`."""
    ids = array("i", tokens[: len(tokens) - len(tokens) % page_size])
    if sys.byteorder == "big":
        ids.byteswap()  # names are the same on every machine
    raw = ids.tobytes()
    step = 4 * page_size
    names: list[bytes] = []
    blake2b = hashlib.blake2b
    for start in range(0, len(raw), step):
        parent = blake2b(parent + raw[start : start + step], digest_size=NAME_BYTES).digest()
        names.append(parent)
    return names
