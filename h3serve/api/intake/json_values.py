"""Bounded JSON parsing for request bodies and form fields, and the readers of the values the request model does
not type itself (JSON text in a form field, objects, media URLs).

Each raises `APIError` 400 naming the field, so a client learns which value was wrong and why.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from h3serve.api.error_envelope import APIError, bad_request
from h3serve.rules import limits
from h3serve.rules.shown import shown

# Far above any valid request (extra_params.target.frame_indices is 4 levels deep), far below what would exhaust
# the stack of json.loads or of any code that walks a value recursively.
MAX_NESTING = 32
# Values in one JSON text: a request has a few dozen fields and at most 12 media inputs; 10x the longest prompt.
MAX_JSON_ITEMS = 10 * limits.MAX_PROMPT_CHARS


def _structure_error(value: Any, limit: int = MAX_NESTING) -> str | None:
    """Why a parsed JSON value is refused (too deep, or a string that is not valid Unicode), else None.

    Walked without recursion. A lone surrogate (`"\\ud800"`) is legal JSON but no UTF-8 text: stored, it would
    make every response that echoes it fail to serialise."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not is_unicode(item):
                return f"a string holds a lone surrogate ({preview(item)}), which is not Unicode text"
            continue
        if isinstance(item, dict):
            stack.extend((key, depth) for key in item)
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return f"nested more than {limit} levels deep"
        stack.extend((child, depth + 1) for child in children)
    return None


def is_unicode(text: str) -> bool:
    """Whether `text` encodes to UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def preview(value: Any) -> str:
    """A value for an error message: short and ASCII (a client's 10,000-digit number is not echoed back)."""
    return shown(value)


def _add(seen: set[str], key: str) -> bool:
    """Add `key` to `seen`; False, so that a scan reads on."""
    seen.add(key)
    return False


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One rule for every body: a field given twice is refused (as a repeated form field is), never resolved."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or _add(seen, k))
        raise ValueError(f"the key {preview(duplicate)} appears more than once in an object")
    return obj


def parse_json(text: str | bytes) -> Any:
    """`json.loads` that also refuses more than `MAX_JSON_ITEMS` values, nesting deeper than `MAX_NESTING`,
    duplicate keys and lone surrogates; `ValueError` with a one-line reason."""
    # Counted before parsing (a C-speed scan): parsing millions of values holds the GIL for seconds. Every
    # comma counts, even inside strings, so this over-counts; a prompt of MAX_PROMPT_CHARS commas still passes.
    separators = text.count(b",") if isinstance(text, bytes) else text.count(",")
    if separators >= MAX_JSON_ITEMS:
        raise ValueError(f"more than {MAX_JSON_ITEMS} values (a request has at most a few dozen)")
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except RecursionError:  # deep enough to exhaust the parser's stack
        raise ValueError(f"nested more than {MAX_NESTING} levels deep") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at position {e.pos}") from None
    except UnicodeDecodeError as e:  # bytes that are not UTF-8
        raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:  # a duplicate key, or an integer past Python's digit limit
        raise ValueError(str(e).split(";")[0]) from None
    if (reason := _structure_error(value)) is not None:
        raise ValueError(reason)
    return value


def _single(value: Any, param: str) -> Any:
    if isinstance(value, list):
        raise bad_request(f"{param}: given more than once", param)
    return value


def as_text(value: Any, param: str) -> str:
    value = _single(value, param)
    if not isinstance(value, str):
        raise bad_request(f"{param}: must be a string, got {type(value).__name__}", param)
    if not is_unicode(value):
        raise bad_request(f"{param}: holds a lone surrogate ({preview(value)}), which is not Unicode text", param)
    return value


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


def reject_unknown(names: list[str], known_hint: str | None = None) -> None:
    """400 naming every field the server does not accept."""
    if not names:
        return
    plural = "s" if len(names) > 1 else ""
    message = f"Unknown field{plural}: {', '.join(names)}."
    if known_hint:
        message += f" {known_hint}"
    raise APIError(400, message, "unknown_field", names[0])
