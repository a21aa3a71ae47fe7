"""Counting the tensor bytes a loader reads from safetensors files, per file: every loaded h3serve module's
`safe_open` (and `safetensors.safe_open`) is wrapped for the duration, so whatever reader a loader goes through is
counted (a whole tensor by `get_tensor`, a slice by `get_slice(...)[...]`; headers and shapes are free)."""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import safetensors

from h3serve.checkpoint import native_names
from h3serve.checkpoint.file_reading import safetensors_header
from h3serve.loading.tensors import STORED_DTYPES


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Slice:
    def __init__(self, inner, count):
        self._inner, self._count = inner, count

    def __getitem__(self, index):
        tensor = self._inner[index]
        self._count(_nbytes(tensor))
        return tensor

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Handle:
    def __init__(self, inner, path: str, counts: Counter):
        self._inner, self._path, self._counts = inner, path, counts

    def _count(self, n: int) -> None:
        self._counts[self._path] += n

    def get_tensor(self, key):
        tensor = self._inner.get_tensor(key)
        self._count(_nbytes(tensor))
        return tensor

    def get_slice(self, key):
        return _Slice(self._inner.get_slice(key), self._count)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@contextmanager
def counting_reads() -> Iterator[Counter]:
    """Yields a Counter: file path -> tensor bytes read from it while the context is open."""
    real = safetensors.safe_open
    counts: Counter = Counter()

    def counted(path, *args, **kwargs):
        return _Handle(real(path, *args, **kwargs), str(path), counts)

    modules = [m for n, m in list(sys.modules.items()) if n.startswith("h3serve") and vars(m).get("safe_open") is real]
    for module in [*modules, safetensors]:
        module.safe_open = counted
    try:
        yield counts
    finally:
        for module in [*modules, safetensors]:
            module.safe_open = real


def read_under(counts: Counter, folder: Path) -> int:
    """Bytes read from the files in `folder`."""
    return sum(n for path, n in counts.items() if Path(path).parent == folder)


def dit_file_bytes(folder: Path, lazy: Callable[[str], bool]) -> tuple[int, int, int]:
    """A DiT folder's (resident bytes, block bytes: those of the tensors `lazy` names, the slack of a piece's
    stretch of each block tensor: two partial stored rows, and its alignment gap in a flat buffer, under 64 B)."""
    files = sorted(folder.glob("*.safetensors"))
    headers = {file: safetensors_header(file) for file in files}
    native = native_names.is_native_key_set([k for header in headers.values() for k in header])
    resident = blocks = slack = 0
    for header in headers.values():
        for key, info in header.items():
            if key == "__metadata__":
                continue
            n = math.prod(info["shape"]) * STORED_DTYPES[info["dtype"]].itemsize
            if not lazy(native_names.native_to_diffusers_name(key) if native else key):
                resident += n
                continue
            blocks += n
            parts = 3 if ".qkv_proj." in key else 1  # a native fused QKV holds three model tensors
            slack += parts * (2 * n // (info["shape"][0] if info["shape"] else 1) + 64)
    return resident, blocks, slack
