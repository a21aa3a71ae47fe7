"""Pinned host memory at its real size: one allocation per weight unit, its tensors as views.

`Tensor.pin_memory()` goes through PyTorch's caching host allocator, which rounds every allocation up to a power
of two and keeps freed blocks cached: a DiT block's dozen tensors pinned one by one take about a third more than
their bytes, and the planner's host figure is wrong by as much. An arena is one ordinary host allocation of exactly
the unit's bytes, page-locked in place with `cudaHostRegister` (no rounding), holding every tensor as a view.
"""

from __future__ import annotations

import weakref

import torch

_PINNED = {"bytes": 0, "arenas": 0}  # registered now, in this process


def pinned_bytes() -> int:
    """Host bytes page-locked by arenas in this process (what the planner's host figure must equal)."""
    return _PINNED["bytes"]


def _register(ptr: int, size: int) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {size} host bytes failed (cudaError {code})")


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _release(ptr: int, size: int) -> None:
    _unregister(ptr)
    _PINNED["bytes"] -= size
    _PINNED["arenas"] -= 1


class HostArena:
    """The given tensors copied into one host buffer of exactly their bytes; `views` in the same order.

    Views are laid out by element size, widest first, so each starts at a multiple of its own element size with
    no padding at all: `nbytes` is the sum of the tensors' bytes."""

    def __init__(self, tensors: list[torch.Tensor], pin: bool):
        order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        views: list[torch.Tensor | None] = [None] * len(tensors)
        offset = 0
        for i in order:
            t = tensors[i]
            size = t.numel() * t.element_size()
            view = self.buffer[offset : offset + size].view(t.dtype).view(t.shape)
            view.copy_(t)
            views[i] = view
            offset += size
        self.views: list[torch.Tensor] = views  # type: ignore[assignment]
        self.pinned = pin and self.nbytes > 0
        if self.pinned:
            ptr = self.buffer.data_ptr()
            _register(ptr, self.nbytes)
            _PINNED["bytes"] += self.nbytes
            _PINNED["arenas"] += 1
            # The buffer outlives every view (they share its storage); unregister when the arena goes.
            weakref.finalize(self, _release, ptr, self.nbytes)
