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
        self._lay_out([(t.shape, t.dtype) for t in tensors])
        for view, t in zip(self.views, tensors, strict=True):
            view.copy_(t)
        self._pin(pin)

    @classmethod
    def empty(cls, specs: list[tuple[torch.Size, torch.dtype]], pin: bool) -> HostArena:
        """An arena of uninitialised views of these shapes and dtypes, pinned before anything is written to it (so
        device-to-host copies into its views run asynchronously)."""
        arena = cls.__new__(cls)
        arena._lay_out(specs)
        arena._pin(pin)
        return arena

    def _lay_out(self, specs: list[tuple[torch.Size, torch.dtype]]) -> None:
        order = sorted(range(len(specs)), key=lambda i: -specs[i][1].itemsize)
        sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
        self.nbytes = sum(sizes)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        views: list[torch.Tensor | None] = [None] * len(specs)
        offset = 0
        for i in order:
            shape, dtype = specs[i]
            views[i] = self.buffer[offset : offset + sizes[i]].view(dtype).view(shape)
            offset += sizes[i]
        self.views: list[torch.Tensor] = views  # type: ignore[assignment]

    def _pin(self, pin: bool) -> None:
        self.pinned = pin and self.nbytes > 0
        if self.pinned:
            ptr = self.buffer.data_ptr()
            _register(ptr, self.nbytes)
            _PINNED["bytes"] += self.nbytes
            _PINNED["arenas"] += 1
            # The buffer outlives every view (they share its storage); unregister when the arena goes.
            weakref.finalize(self, _release, ptr, self.nbytes)


def pinned_copy(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], HostArena]:
    """Host copies of `tensors` (on one device) in one pinned arena of exactly their bytes, and the arena (keep it
    with them: it unpins when it goes). From a GPU the copies are queued on the current stream and waited for once,
    not one blocking copy per tensor; the AdaLN memo's store holds its entries this way (`AdaLNMemo(host_copy=)`)."""
    arena = HostArena.empty([(t.shape, t.dtype) for t in tensors], pin=True)
    for view, t in zip(arena.views, tensors, strict=True):
        view.copy_(t, non_blocking=True)
    cuda = [t.device for t in tensors if t.device.type == "cuda"]
    if cuda:
        torch.cuda.current_stream(cuda[0]).synchronize()
    return arena.views, arena
