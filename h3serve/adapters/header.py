"""A safetensors file's header without torch: tensor names, dtypes, shapes and the `__metadata__` strings.

The format is an 8-byte little-endian header length followed by that many bytes of JSON; reading it costs one
small read, so the API process checks an adapter's keys and shapes before a request is queued.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from h3serve.errors import ClientError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


class AdapterError(ClientError, ValueError):
    """An adapter file or directory breaks its contract; the message names the file and what is wrong (a request
    that names such an adapter is refused; at start-up it becomes a ConfigError)."""

    code = "invalid_request"


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        size = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}
        count = 1
        for n in self.shape:
            count *= n
        return count * size.get(self.dtype, 1)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_header(path: str | Path) -> SafetensorsHeader:
    """Parse the header of `path`; `AdapterError` naming the file when it is not a safetensors file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise AdapterError(f"{path.name}: not a safetensors file (shorter than its header length)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise AdapterError(f"{path.name}: not a safetensors file (header of {length} bytes)")
            raw = f.read(length)
    except OSError as e:
        raise AdapterError(f"{path.name}: cannot be read ({e.strerror})") from None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterError(f"{path.name}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path.name}: not a safetensors file (its header is not a JSON object)")
    metadata = data.pop("__metadata__", None) or {}
    tensors = {}
    for key, entry in data.items():
        if not isinstance(entry, dict) or "shape" not in entry or "dtype" not in entry:
            raise AdapterError(f"{path.name}: tensor {key!r} has no dtype/shape in the header")
        tensors[key] = TensorInfo(str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
    return SafetensorsHeader(path, tensors, {str(k): str(v) for k, v in metadata.items()})
