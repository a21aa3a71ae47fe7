"""Hand the C heap's free pages back to the operating system (glibc's `malloc_trim`).

Freed tensors below glibc's mmap threshold return to the heap, not to the OS: the resident set a stage leaves
behind (the DiT's activations after denoising) would otherwise stand under the next stage's peak (the VAE
decode). A no-op where the C library has no `malloc_trim` (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Return the heap's free pages to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
