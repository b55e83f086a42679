"""Answer extraction shared by the tasks (TOPR §4.1, FPA App. B.1). Every function runs in linear time.

- `answer_after_magic`: GSM8K/arithmetic style, the number after the last "The answer is".
- `last_boxed`: MATH style, the content of the last `\\boxed{...}` with balanced braces.
- `normalize_number`: remove thousands commas, `$`, `%`, a trailing period; exact decimal.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

MAGIC = "The answer is"
# The argument of a brace-less `\\boxed 5`: up to the next whitespace or `$`.
_BARE_ARG = re.compile(r"[^\s$]+")
# A number: optional sign, digits with optional thousands commas, optional decimals. Bounded
# repetition keeps matching linear on adversarial input.
_NUMBER = re.compile(r"[-−]?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def normalize_number(text: str) -> Decimal | None:
    """'$1,234.50.' -> Decimal('1234.50'); None when `text` is not a plain number."""
    s = text.strip().rstrip(".").strip()
    s = s.replace("−", "-").replace("$", "").replace(",", "").replace("%", "").strip()
    if not s or len(s) > 64:
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def numbers_equal(a: str, b: str) -> bool:
    x, y = normalize_number(a), normalize_number(b)
    return x is not None and y is not None and x == y


def answer_after_magic(text: str, magic: str = MAGIC) -> str | None:
    """The first number after the LAST occurrence of `magic` (case-insensitive), normalised.

    Returns None (invalid) when the magic string is missing or no number follows it on the
    same line.
    """
    pos = text.lower().rfind(magic.lower())
    if pos < 0:
        return None
    rest = text[pos + len(magic) : pos + len(magic) + 200].split("\n", 1)[0]
    match = _NUMBER.search(rest)
    if match is None:
        return None
    value = normalize_number(match.group(0))
    if value is None:
        return None
    return format_decimal(value)


def format_decimal(value: Decimal) -> str:
    """Canonical text of a number: no exponent, no trailing zeros ('12.50' -> '12.5')."""
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces.

    Also accepts the brace-less form `\\boxed 5`. None when there is no complete box. One
    pass matches every brace first, so many unclosed boxes cost O(n), not O(n²).
    """
    if "\\boxed" not in text and "\\fbox" not in text:
        return None
    close_of: dict[int, int] = {}
    stack: list[int] = []
    for i, c in enumerate(text):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            close_of[stack.pop()] = i
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)", text)]
    for i in reversed(starts):
        if i < len(text) and text[i] == " ":
            # `\\boxed 5`: the argument runs to the next whitespace or `$`.
            arg = _BARE_ARG.match(text, i + 1)
            if arg is not None:
                return arg.group(0)
        elif i < len(text) and text[i] == "{" and i in close_of:
            return text[i + 1 : close_of[i]]
    return None
