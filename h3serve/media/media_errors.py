"""The intake's errors: every broken rule names the file, the field and the limit, in one line."""

from __future__ import annotations

from h3serve.errors import ClientError


def one_line(text: str, max_chars: int = 160) -> str:
    text = "".join(c if c.isprintable() else "?" for c in str(text))
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


class MediaError(ClientError, ValueError):
    """An input file breaks a rule. `str(err)` is one line: "field ('file'): what is wrong; limit: the rule"."""

    code = "invalid_media"

    def __init__(self, file: str, field: str, message: str, limit: str):
        self.file = one_line(file)
        self.field = field
        self.message = one_line(message, 240)
        self.limit = limit
        super().__init__(f"{field} ({self.file!r}): {self.message}; limit: {limit}")


class MediaFormatError(MediaError):
    """Unknown bytes, an unsupported format, container or codec, or bytes that contradict the declared kind."""


class MediaDecodeError(MediaError):
    """The file is unreadable, corrupt or truncated."""


class MediaLimitError(MediaError):
    """A per-file limit: byte size, edges, aspect ratio, duration, decoded size."""


class ReferenceSetError(MediaError):
    """A limit on the Ref2VA reference set: counts per kind and in total, total durations, audio pairing."""
