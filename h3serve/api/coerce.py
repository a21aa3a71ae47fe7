"""Typed readers for request values that arrive as form strings (multipart, urlencoded) or JSON values.

Each raises `APIError` 400 naming the field, so a client learns which value was wrong and why.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from h3serve.api.errors import APIError, bad_request

_INT = re.compile(r"^[+-]?\d+$")
# Far above any valid request (extra_params.target.frame_indices is 4 levels deep), far below what would exhaust
# the stack of json.loads or of any code that walks a value recursively.
MAX_NESTING = 32


def _too_deep(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether lists/objects nest more than `limit` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse_json(text: str | bytes) -> Any:
    """`json.loads` that also refuses nesting deeper than `MAX_NESTING`; `ValueError` with a one-line reason."""
    too_deep = ValueError(f"nested more than {MAX_NESTING} levels deep")
    try:
        value = json.loads(text)
    except RecursionError:  # deep enough to exhaust the parser's stack
        raise too_deep from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at position {e.pos}") from None
    except ValueError as e:  # bytes that are not UTF-8
        raise ValueError(f"not UTF-8 text ({e})") from None
    if _too_deep(value):
        raise too_deep
    return value


def _single(value: Any, param: str) -> Any:
    if isinstance(value, list):
        raise bad_request(f"{param}: given more than once", param)
    return value


def as_text(value: Any, param: str) -> str:
    value = _single(value, param)
    if not isinstance(value, str):
        raise bad_request(f"{param}: must be a string, got {type(value).__name__}", param)
    return value


def as_int(value: Any, param: str) -> int:
    value = _single(value, param)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _INT.match(value.strip()):
        return int(value.strip())
    raise bad_request(f"{param}: must be an integer, got {value!r}", param)


def as_number(value: Any, param: str) -> float:
    value = _single(value, param)
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise bad_request(f"{param}: must be a finite number, got {value!r}", param)
    return number


def as_json(value: Any, param: str) -> Any:
    """A structured value: already structured (JSON body, bracketed form keys) or JSON text in a form field."""
    if isinstance(value, str):
        try:
            return parse_json(value)
        except ValueError as e:
            raise bad_request(f"{param}: invalid JSON ({e})", param, "invalid_json") from None
    return value


def as_object(value: Any, param: str) -> dict[str, Any]:
    value = as_json(_single(value, param), param)
    if not isinstance(value, dict):
        raise bad_request(f"{param}: must be a JSON object, got {type(value).__name__}", param)
    return value


def as_int_list(value: Any, param: str) -> tuple[int, ...]:
    value = as_json(value, param)
    items = value if isinstance(value, list) else [value]
    return tuple(as_int(v, f"{param}[{i}]") for i, v in enumerate(items))


def reject_unknown(names: list[str], known_hint: str | None = None) -> None:
    """400 naming every field the server does not accept."""
    if not names:
        return
    plural = "s" if len(names) > 1 else ""
    message = f"Unknown field{plural}: {', '.join(names)}."
    if known_hint:
        message += f" {known_hint}"
    raise APIError(400, message, "unknown_field", names[0])
