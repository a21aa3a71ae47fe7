"""How a client's value appears in an error message: short, one line, ASCII, and never formatted whole.

A message may echo what the client sent, so the client sees what was wrong, but only a bounded piece of it: a
60 KB id or a 10,000-digit number is cut, not sent back (and an integer past Python's 4,300-digit conversion limit
would raise while being formatted, turning a 400 into a 500)."""

from __future__ import annotations

import math

MAX_SHOWN_CHARS = 40  # of a value inside a message
_LONG_INT_BITS = 128  # past this an integer is described by its size, not written out


def shown(value: object, max_chars: int = MAX_SHOWN_CHARS) -> str:
    """`value` as `ascii()` writes it, cut to `max_chars` (an integer too long to show is described instead)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _LONG_INT_BITS:
        digits = math.floor(value.bit_length() * math.log10(2)) + 1
        return f"{'a negative' if value < 0 else 'an'} integer of about {digits:,} digits"
    if isinstance(value, str) and len(value) > max_chars:
        value = value[:max_chars]  # ascii() of the whole string would copy all of it first
    if isinstance(value, list | tuple | dict | set) and len(value) > max_chars:
        return f"a {type(value).__name__} of {len(value):,} items"
    try:
        text = ascii(value)
    except ValueError:  # a nested integer past the conversion limit
        return f"a {type(value).__name__} holding a very long number"
    return cut(text, max_chars)


def cut(text: str, max_chars: int = MAX_SHOWN_CHARS) -> str:
    """`text` at most `max_chars` long: its start and an ellipsis."""
    return text if len(text) <= max_chars else f"{text[: max_chars - 3]}..."
