"""A pydantic `ValidationError` of the create request's fields as the 400 a client reads: the field's dotted name,
what it must be (the bounds come from the schema itself) and the value as the client wrote it."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from h3serve.api.error_envelope import APIError
from h3serve.api.intake.json_values import preview
from h3serve.api.intake.request_model import VideoCreateFields
from h3serve.rules.names import SAMPLE_SOLVERS

_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_EXAMPLES = {"size": "1344x768 (WIDTHxHEIGHT)", "aspect_ratio": "16:9 (W:H), a number such as 1.7778, or auto",
             "sample_solver": f"{' or '.join(SAMPLE_SOLVERS)} (any case)"}


def field_error(e: ValidationError) -> APIError:
    """The 400 naming the first bad field: of union members' errors, the one with the longest location."""
    error = max(e.errors(), key=lambda err: len([p for p in err["loc"] if isinstance(p, str)]))
    param = ".".join(str(p) for p in error["loc"] if not _is_union_tag(p))
    return APIError(400, f"{param}: {_message(error)}", "invalid_value", param)


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    return schema["$defs"].get(node.get("$ref", "").split("/")[-1], node) if "$ref" in node else node


def _bounds(loc: tuple[Any, ...]) -> str | None:
    """'between A and B' from the schema of the field at `loc`, for range errors."""
    schema: dict[str, Any] = VideoCreateFields.model_json_schema()
    node: dict[str, Any] = schema
    for part in loc:
        if isinstance(part, int):
            continue
        node = _resolve(schema, node.get("properties", {}).get(part) or node)
        for option in node.get("anyOf", ()):
            option = _resolve(schema, option)
            if "minimum" in option or "exclusiveMinimum" in option or "properties" in option:
                node = option
    lo, hi = node.get("minimum", node.get("exclusiveMinimum")), node.get("maximum")
    return None if lo is None or hi is None else f"between {_bound(lo)} and {_bound(hi)}"


def _bound(value: int | float) -> str:
    """A schema bound as the client must read it: an integer exactly (2**63 - 1, not 9.22337e+18)."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def _shown(raw: Any) -> str:
    """The offending value as the client wrote it: a form field's "500" reads 500, not '500'."""
    if isinstance(raw, str) and _NUMBER.fullmatch(raw.strip()):
        text = raw.strip()
        return text if len(text) <= 40 else f"{text[:37]}..."
    return preview(raw)


def _message(error: ErrorDetails) -> str:
    value = _shown(error.get("input"))
    kind = error["type"]
    if error["loc"] == ("prompt",) and kind in ("string_too_short", "string_pattern_mismatch"):
        return "must not be empty"
    if kind.startswith("int_"):
        return f"must be an integer, got {value}"
    if kind in ("float_parsing", "float_type", "finite_number"):
        return f"must be a finite number, got {value}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        bounds = _bounds(tuple(error["loc"]))
        return f"must be {bounds}, got {value}" if bounds else f"{error['msg'].lower()}, got {value}"
    if kind == "string_pattern_mismatch":
        example = _EXAMPLES.get(str(error["loc"][-1]), "the documented form")
        return f"must look like {example}, got {value}"
    return f"{error['msg'][0].lower()}{error['msg'][1:]}, got {value}"


def _is_union_tag(part: Any) -> bool:
    """pydantic names union members in error locations (`list[...]`, `literal[...]`): not field names."""
    return isinstance(part, str) and (
        "[" in part or part in ("int", "float", "str", "bool") or part.startswith("constrained-")
    )
