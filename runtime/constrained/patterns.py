"""Regex building blocks: escaping, `choices`, `dtype`, numeric ranges and JSON string formats.

Every regex here is written in the syntax both Rust's `regex` crate (outlines-core) and Python's
`re` read the same way, so tests can check generated text with `re.fullmatch`.
"""

from __future__ import annotations

from collections.abc import Sequence

# Characters with a meaning in a Rust or Python regex; everything else stands for itself.
_META = set("\\.+*?()|[]{}^$#&-~ ")


def escape(text: str) -> str:
    """`text` as a literal regex (Rust and Python agree on `\\` before ASCII punctuation)."""
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)  # \xhh, \uhhhh and \Uhhhhhhhh read the same in Rust and Python
            out.append(
                f"\\x{code:02x}"
                if code <= 0xFF
                else f"\\u{code:04x}"
                if code <= 0xFFFF
                else f"\\U{code:08x}"
            )
    return "".join(out)


def choices_regex(choices: Sequence[str]) -> str:
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        raise ValueError(f"choices: expected a list of strings, got {type(choices).__name__}")
    if not choices:
        raise ValueError("choices: the list is empty")
    bad = [c for c in choices if not isinstance(c, str)]
    if bad:
        raise ValueError(f"choices: every choice must be a string, got {bad[0]!r}")
    # Longest first: a leftmost-first automaton would otherwise stop at "a" in (?:a|ab).
    ordered = sorted(dict.fromkeys(choices), key=len, reverse=True)
    return "(?:" + "|".join(escape(c) for c in ordered) + ")"


INT_REGEX = r"-?(?:0|[1-9][0-9]*)"
FLOAT_REGEX = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
BOOL_REGEX = r"(?:True|False)"
JSON_STRING_INNER = r'(?:[^"\\\x00-\x1f\x7f-\x9f]|\\["\\/bfnrt])'
JSON_STRING_REGEX = f'"{JSON_STRING_INNER}*"'

DTYPE_REGEXES = {
    "int": INT_REGEX,
    "float": FLOAT_REGEX,
    "bool": BOOL_REGEX,
    "str": JSON_STRING_REGEX,
}


def dtype_regex(dtype: type | str) -> str:
    """int / float / bool / str (the type or its name) -> regex; `str` is a JSON string literal."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", repr(dtype))
    if name not in DTYPE_REGEXES:
        raise ValueError(f"dtype: {name!r} is not supported (supported: int, float, bool, str)")
    return DTYPE_REGEXES[name]


# `\d`, `\w` and `\s` as ASCII classes (ECMA-262's digits and word characters, and the ASCII
# whitespace), inside a class and out; negated inside a class as a nested class (Rust's syntax)
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\x0b\\x0c\\r "}


def ascii_classes(pattern: str) -> str:
    """`pattern` with `\\d`, `\\w`, `\\s` and their negations spelled as ASCII classes.

    Rust's regex (both grammar backends) reads them as Unicode classes, where `\\d` admits
    `١` or `৪`; JSON Schema's `pattern` (ECMA-262) and users of `regex=` mean `[0-9]`. Unicode
    classes stay available by name (`\\p{Nd}`)."""
    out: list[str] = []
    depth = 0  # inside how many `[...]`
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            letter = pattern[i + 1]
            spelled = _ASCII_CLASSES.get(letter.lower())
            if spelled is None:
                out.append(pattern[i : i + 2])
            elif letter.islower():
                out.append(spelled if depth else f"[{spelled}]")
            else:
                out.append(f"[^{spelled}]")
            i += 2
            continue
        if ch == "[":
            depth += 1
            out.append(ch)
            i += 1
            if pattern.startswith("^", i):  # a class's leading `^` or `]` is not its end
                out.append("^")
                i += 1
            if pattern.startswith("]", i):
                out.append("]")
                i += 1
            continue
        if ch == "]" and depth:
            depth -= 1
        out.append(ch)
        i += 1
    return "".join(out)


# JSON string formats: full JSON string regexes (quotes included) that never admit a character
# JSON would need escaped, so every match is also a valid JSON string.
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = (
    r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"
    r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
_URI_CHAR = r"[a-zA-Z0-9\-._~%!$&'()*+,;=:@/]"
FORMAT_REGEXES = {
    "date": f'"{_DATE}"',
    "time": f'"{_TIME}"',
    "date-time": f'"{_DATE}T{_TIME}"',
    "uuid": r'"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"',
    "email": rf'"[a-zA-Z0-9_%+\-]+(?:\.[a-zA-Z0-9_%+\-]+)*@(?:{_LABEL}\.)+[a-zA-Z]{{2,24}}"',
    "hostname": rf'"{_LABEL}(?:\.{_LABEL})*"',
    "ipv4": rf'"{_OCTET}(?:\.{_OCTET}){{3}}"',
    "uri": rf'"[a-zA-Z][a-zA-Z0-9+.\-]*://(?:{_LABEL}(?:\.{_LABEL})*)(?::[0-9]{{1,5}})?(?:/{_URI_CHAR}*)?(?:\?{_URI_CHAR}*)?"',
}


# numeric ranges


def _same_length_range(low: str, high: str) -> list[str]:
    """Regexes for the digit strings from `low` to `high` (same length, leading zeros kept)."""
    if low == high:
        return [low]
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    if low[0] == high[0]:
        return [low[0] + rest for rest in _same_length_range(low[1:], high[1:])]
    width = len(low) - 1
    parts: list[str] = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * width:
        parts += [low[0] + rest for rest in _same_length_range(low[1:], "9" * width)]
        first += 1
    tail: list[str] = []
    if high[1:] != "9" * width:
        tail = [high[0] + rest for rest in _same_length_range("0" * width, high[1:])]
        last -= 1
    if first <= last:
        digit = str(first) if first == last else f"[{first}-{last}]"
        parts.append(digit + ("[0-9]" if width == 1 else f"[0-9]{{{width}}}"))
    return parts + tail


def natural_range_regex(low: int, high: int | None) -> str:
    """Regex for the decimal integers low..high (no sign, no leading zeros); `high=None`:
    unbounded."""
    if low < 0 or (high is not None and high < low):
        raise ValueError(f"natural_range_regex: bad range {low}..{high}")
    parts: list[str] = []
    top = high if high is not None else 10 ** len(str(low)) - 1
    for digits in range(len(str(low)), len(str(top)) + 1):
        start = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        end = min(top, 10**digits - 1)
        if start <= end:
            parts += _same_length_range(str(start), str(end))
    if high is None:
        parts.append(f"[1-9][0-9]{{{len(str(low))},}}")
    return "(?:" + "|".join(parts) + ")"


def integer_range_regex(low: int | None, high: int | None) -> str:
    """Regex for the integers in [low, high] (None: unbounded), JSON spelling."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"empty integer range [{low}, {high}]")
    parts = []
    if low is None or low < 0:  # negative part: magnitudes max(1, -high) .. -low
        magnitude_low = 1 if high is None or high >= 0 else -high
        parts.append("-" + natural_range_regex(magnitude_low, None if low is None else -low))
    if high is None or high >= 0:
        parts.append(natural_range_regex(max(low or 0, 0), high))
    return "(?:" + "|".join(parts) + ")"


_ANY_FRACTION = r"(?:\.[0-9]+)?"
_ZERO_FRACTION = r"(?:\.0+)?"
_NONZERO_FRACTION = r"\.[0-9]*[1-9][0-9]*"


def _magnitude_regex(
    low: int, low_inclusive: bool, high: int | None, high_inclusive: bool
) -> str | None:
    """Unsigned decimals m (no exponent) with low <(=) m <(=) high; None when there are none."""
    if high is not None and (
        high < low or (high == low and not (low_inclusive and high_inclusive))
    ):
        return None
    parts = []
    first = low if low_inclusive else low + 1
    last = None if high is None else high - 1
    if last is None or first <= last:
        parts.append(natural_range_regex(first, last) + _ANY_FRACTION)
    if not low_inclusive and (high is None or high > low):
        parts.append(f"{low}{_NONZERO_FRACTION}")
    if high is not None and high_inclusive:
        parts.append(f"{high}{_ZERO_FRACTION}")
    return "(?:" + "|".join(parts) + ")"


def number_range_regex(
    low: int | None, high: int | None, *, low_inclusive: bool = True, high_inclusive: bool = True
) -> str:
    """Regex for JSON numbers x (no exponent) with low <(=) x <(=) high; bounds are integers or
    None."""
    parts = []
    if low is None or low < 0:  # x < 0: magnitudes -x in (max(0, -high), -low)
        if high is None or high >= 0:
            magnitude = _magnitude_regex(0, False, None if low is None else -low, low_inclusive)
        else:
            magnitude = _magnitude_regex(
                -high, high_inclusive, None if low is None else -low, low_inclusive
            )
        if magnitude is not None:
            parts.append("-" + magnitude)
    if high is None or high >= 0:
        if low is None or low < 0:
            magnitude = _magnitude_regex(0, True, high, high_inclusive)
        else:
            magnitude = _magnitude_regex(low, low_inclusive, high, high_inclusive)
        if magnitude is not None:
            parts.append(magnitude)
    if not parts:
        raise ValueError(f"empty number range {low}..{high}")
    return "(?:" + "|".join(parts) + ")"
