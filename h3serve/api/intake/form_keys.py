"""Rebuild nested values from bracketed form keys, as the OpenAI SDK flattens `extra_body` into multipart.

`cfg[x]=1` -> {"cfg": {"x": "1"}};  `tags[]=a, tags[]=b` -> {"tags": ["a", "b"]};
`refs[][url]=u1, refs[][url]=u2` -> {"refs": [{"url": "u1"}, {"url": "u2"}]};  `a[0]=x, a[1]=y` -> {"a": ["x", "y"]};
a plain key sent twice (`a=1, a=2`) -> {"a": ["1", "2"]}. Leaves stay strings: the request model coerces them.
"""

from __future__ import annotations

import re
from typing import Any

from h3serve.api.intake.json_values import MAX_NESTING
from h3serve.errors import ClientError

_KEY = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])*)$")
_SEGMENT = re.compile(r"\[([^\[\]]*)\]")
Node = dict[str, Any] | list[Any]  # a rebuilt value that holds others


class BracketError(ClientError, ValueError):
    """Two keys give one name two different shapes (`a=1` and `a[b]=2`), or a key nests too deep."""

    code = "invalid_body"

    def __init__(self, key: str, reason: str = "conflicts with another field of the same name"):
        super().__init__(f"form field {key[:100]!r} {reason}")
        self.key = key


def split_key(key: str) -> list[str]:
    """`a[b][]` -> ["a", "b", ""]; a key that is not well-formed bracket syntax stays whole."""
    match = _KEY.match(key)
    if not match:
        return [key]
    return [match.group(1), *_SEGMENT.findall(match.group(2))]


def base_name(key: str) -> str:
    return split_key(key)[0]


def _container(parent: Node, segment: str, rest: list[str], key: str) -> Node:
    """The dict or list at `parent[segment]` that the remaining path `rest` descends into (created if new)."""
    kind = list if rest[0] == "" else dict
    if isinstance(parent, list):
        # `a[][x]=1, a[][y]=2` fill one object; a key seen again starts the next object.
        last = parent[-1] if parent else None
        if kind is dict and isinstance(last, dict) and (len(rest) > 1 or rest[0] not in last):
            return last
        fresh: Node = kind()
        parent.append(fresh)
        return fresh
    existing = parent.setdefault(segment, kind())
    if not isinstance(existing, kind):
        raise BracketError(key)
    return existing


def _set_leaf(parent: Node, segment: str, value: Any, key: str) -> None:
    if isinstance(parent, list):
        parent.append(value)
    elif segment not in parent:
        parent[segment] = value
    elif isinstance(parent[segment], list):
        parent[segment].append(value)
    elif isinstance(parent[segment], dict):
        raise BracketError(key)
    else:
        parent[segment] = [parent[segment], value]


def _indexed_to_lists(value: Any) -> Any:
    if isinstance(value, list):
        return [_indexed_to_lists(v) for v in value]
    if not isinstance(value, dict):
        return value
    converted = {k: _indexed_to_lists(v) for k, v in value.items()}
    if converted and all(k.isdigit() for k in converted):
        return [converted[k] for k in sorted(converted, key=int)]
    return converted


def unflatten(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Nested fields from (key, value) pairs in the order they arrived."""
    root: dict[str, Any] = {}
    for key, value in pairs:
        path = split_key(key)
        if len(path) > MAX_NESTING:  # the rebuilt value is walked recursively: bound its depth
            raise BracketError(key, f"nests more than {MAX_NESTING} levels deep")
        parent: Node = root
        for depth, segment in enumerate(path[:-1]):
            parent = _container(parent, segment, path[depth + 1 :], key)
        _set_leaf(parent, path[-1], value, key)
    return {k: _indexed_to_lists(v) for k, v in root.items()}
