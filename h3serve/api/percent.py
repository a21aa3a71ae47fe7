"""Percent-decoding at C speed: urllib's decoders loop in Python per escape, so 30 MB of `%XX` cost ~10 s of CPU
for a single request. Results equal `urllib.parse.unquote_to_bytes` (with `+` as a space in form values)."""

from __future__ import annotations

import codecs
import re
import urllib.parse

_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
# Decoded a slice at a time: each C call holds the GIL, and the event loop's thread needs it every few ms.
CHUNK_BYTES = 1 << 20


def percent_decode(data: bytes, plus_is_space: bool = False) -> bytes:
    if plus_is_space:
        data = data.replace(b"+", b" ")
    if b"%" not in data:
        return data
    if _BAD_ESCAPE.search(data):  # a stray '%' stays as it is: rare, so the slow exact decoder handles it
        return urllib.parse.unquote_to_bytes(data)
    out = []
    start = 0
    while start < len(data):
        end = min(start + CHUNK_BYTES, len(data))
        while end < len(data) and b"%" in data[end - 2 : end]:  # never cut an escape in two
            end -= 1
        # Every '%XX' becomes '\xXX' for the C escape decoder; existing backslashes are escaped first.
        out.append(codecs.escape_decode(data[start:end].replace(b"\\", b"\\\\").replace(b"%", b"\\x"))[0])
        start = end
    return b"".join(out)


def form_pairs(body: bytes, max_fields: int) -> list[tuple[str, str]]:
    """`application/x-www-form-urlencoded` fields in order, as `urllib.parse.parse_qsl(keep_blank_values=True)`
    reads them (UTF-8, bad bytes replaced); ValueError past `max_fields`."""
    if body.count(b"&") >= max_fields:
        raise ValueError(f"more than {max_fields} fields")
    pairs = []
    for field in body.split(b"&"):
        if not field:
            continue
        name, _, value = field.partition(b"=")
        pairs.append(
            tuple(percent_decode(part, plus_is_space=True).decode("utf-8", "replace") for part in (name, value))
        )
    return pairs  # type: ignore[return-value]
