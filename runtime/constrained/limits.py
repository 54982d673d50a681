"""Limits on what a constraint may cost to compile, checked before compiling (a `GrammarError`,
HTTP 400, names the limit).

The token index of a regex grows with its automaton: states times the tokens each state allows.
Three shapes make it explode, and each has a cheap static bound here:
- size: `x{5000}` unrolls to 5000 states, `.{0,500}` to 500 states that each allow every token
  (seconds and a gigabyte to compile). The cost counts unrolled atoms, weighted by how wide they
  are.
- repetition bounds: `{m,n}` with huge bounds (caught by the size too, but named on its own).
- ambiguity: `.*a.{10}` needs a state for every subset of the last 11 characters that were an
  `a` (2^11, and gigabytes to compile). The check counts character classes that follow an unbounded
  repeat of a class they overlap.
Nesting is bounded first, so that parsing and walking the pattern stay shallow. A compilation that
still runs too long is abandoned by the engine after `EngineConfig.grammar_compile_timeout`.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

from .base import GrammarError

try:  # Python >= 3.11
    from re import _constants as sre_c
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as sre_c  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]


@dataclass(frozen=True)
class GrammarLimits:
    max_pattern_chars: int = 32 << 10  # a regex, or a schema as compact JSON, for a DFA backend
    max_text_chars: int = 256 << 10  # any constraint's text, for every backend
    max_nesting: int = 32  # groups inside groups; a schema's objects and arrays count double
    max_repeat: int = 2000  # the largest bound of a `{m,n}`
    max_cost: int = 12000  # unrolled atoms: a literal 1, a class 4, a wide class (> 64 chars) 32
    max_ambiguous_tail: int = 8  # overlapping classes after an unbounded repeat of a class


DEFAULT_LIMITS = GrammarLimits()
_WIDE = 64
_ANY = ((0, 0x10FFFF),)


def check_regex(
    pattern: str,
    name: str = "regex",
    limits: GrammarLimits = DEFAULT_LIMITS,
    generated: bool = False,
) -> None:
    """Raises `GrammarError` naming `name` when `pattern` is past a limit. `generated`: built
    from a schema (its length and nesting follow from the schema's, checked there)."""
    if not generated:
        if len(pattern) > limits.max_pattern_chars:
            raise GrammarError(
                f"{name}: {len(pattern)} characters; the limit is {limits.max_pattern_chars}"
            )
        depth = _paren_depth(pattern)
        if depth > limits.max_nesting:
            raise GrammarError(
                f"{name}: groups nested {depth} deep; the limit is {limits.max_nesting}"
            )
    parsed = _parse(pattern)
    if parsed is None:
        _check_bounds_text(pattern, name, limits)  # syntax errors are the compiler's to report
        return
    cost = _Walk(name, limits).cost(parsed)
    if cost > limits.max_cost:
        raise GrammarError(
            f"{name}: the automaton would have about {cost} states (repetitions unrolled); "
            f"the limit is {limits.max_cost}: use smaller {{m,n}} bounds or narrower classes"
        )


def regex_cost(pattern: str, limits: GrammarLimits = DEFAULT_LIMITS) -> int | None:
    """The unrolled size `check_regex` bounds; None when Python cannot parse the pattern or it
    is past a limit (a pattern of unknown cost)."""
    parsed = _parse(pattern)
    if parsed is None:
        return None
    try:
        return _Walk("regex", limits).cost(parsed)
    except GrammarError:
        return None


def _parse(pattern: str) -> Any:
    try:
        with warnings.catch_warnings():  # FutureWarning on `[[`: the compiler's call, not ours
            warnings.simplefilter("ignore")
            return sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None


def check_schema_shape(schema: Any, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Bounds a parsed JSON schema's nesting before anything walks it recursively."""
    limit = 2 * limits.max_nesting
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise GrammarError(f"json_schema: nested deeper than {limit} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _paren_depth(pattern: str) -> int:
    depth = deepest = 0
    escaped = in_class = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(depth - 1, 0)
    return deepest


_BOUNDS = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def _check_bounds_text(pattern: str, name: str, limits: GrammarLimits) -> None:
    for match in _BOUNDS.finditer(pattern):
        for bound in match.groups():
            if bound and int(bound) > limits.max_repeat:
                raise GrammarError(_bound_message(name, match.group(0), limits))


def _bound_message(name: str, shown: str, limits: GrammarLimits) -> str:
    return f"{name}: the repetition {shown} exceeds the limit of {limits.max_repeat}"


class _Walk:
    """Cost and ambiguity of an `sre_parse` tree."""

    def __init__(self, name: str, limits: GrammarLimits) -> None:
        self.name = name
        self.limits = limits

    def cost(self, seq: Any) -> int:
        items = list(seq)
        total = 0
        for i, (op, av) in enumerate(items):
            total += self.item_cost(op, av)
            if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT) and av[1] == sre_c.MAXREPEAT:
                body = _single_set(av[2])
                if body is not None:
                    self.check_tail(body, items[i + 1 :])
        return total

    def item_cost(self, op: Any, av: Any) -> int:
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT) or op == getattr(
            sre_c, "POSSESSIVE_REPEAT", None
        ):
            low, high, body = av
            for bound in (low, high):
                if bound != sre_c.MAXREPEAT and bound > self.limits.max_repeat:
                    shown = "{" + f"{low},{'' if high == sre_c.MAXREPEAT else high}" + "}"
                    raise GrammarError(_bound_message(self.name, shown, self.limits))
            copies = low + 1 if high == sre_c.MAXREPEAT else max(high, 1)
            return self.cost(body) * copies
        if op == sre_c.SUBPATTERN:
            return self.cost(av[-1])
        if op == sre_c.BRANCH:
            return sum(self.cost(b) for b in av[1])
        if op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
            return self.cost(av[1])
        if op == getattr(sre_c, "ATOMIC_GROUP", None):
            return self.cost(av)
        ranges = _set_of(op, av)
        if ranges is None:
            return 1
        width = sum(hi - lo + 1 for lo, hi in ranges)
        return 1 if width == 1 else 4 if width <= _WIDE else 32

    def check_tail(self, repeated: tuple[tuple[int, int], ...], rest: list[Any]) -> None:
        count = 0
        for op, av in rest:
            copies = 1
            if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
                if av[1] == sre_c.MAXREPEAT:
                    break
                copies, body = av[1], _single_set(av[2])
                ranges = body
            else:
                ranges = _set_of(op, av)
            if ranges is None or not _overlap(ranges, repeated):
                break
            if sum(hi - lo + 1 for lo, hi in ranges) > 1:
                count += copies
        if count > self.limits.max_ambiguous_tail:
            raise GrammarError(
                f"{self.name}: an unbounded repeat followed by {count} character classes that "
                f"overlap it needs up to 2^{count} automaton states; the limit is "
                f"{self.limits.max_ambiguous_tail}"
            )


def _set_of(op: Any, av: Any) -> tuple[tuple[int, int], ...] | None:
    """The code point ranges a single-character atom matches (None: not such an atom)."""
    if op == sre_c.LITERAL:
        return ((av, av),)
    if op in (sre_c.ANY, sre_c.NOT_LITERAL):
        return _ANY
    if op != sre_c.IN:
        return None
    ranges = []
    for item_op, item_av in av:
        if item_op == sre_c.LITERAL:
            ranges.append((item_av, item_av))
        elif item_op == sre_c.RANGE:
            ranges.append(item_av)
        else:  # NEGATE, CATEGORY (\d, \w, \s, ...): treat as wide
            return _ANY
    return tuple(ranges)


def _single_set(seq: Any) -> tuple[tuple[int, int], ...] | None:
    items = list(seq)
    while len(items) == 1 and items[0][0] == sre_c.SUBPATTERN:
        items = list(items[0][1][-1])
    if len(items) != 1:
        return None
    return _set_of(*items[0])


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    return any(lo1 <= hi2 and lo2 <= hi1 for lo1, hi1 in a for lo2, hi2 in b)
