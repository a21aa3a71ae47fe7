"""The two device slots streamed blocks pass through: fixed buffers, reused, ordered by events.

Allocating each prefetched block afresh on the copy stream (freed later through `record_stream`) lets the
host queue copies many blocks ahead of the GPU: tens of GB instead of the planned two slots, then allocator
free-and-retry stalls. Here a component's streamed units share two buffers, each the size of its largest unit;
a copy into a slot waits (on the copy stream) for the event the compute stream recorded when the block that last
used the slot finished, and a third concurrent load is an error, never an allocation.
"""

from __future__ import annotations

import torch

SLOT_ALIGN = 256  # bytes: each tensor in a slot starts where a fresh CUDA allocation would be aligned


def slot_layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of `tensors` packed into one slot at `SLOT_ALIGN`, and the bytes the slot needs."""
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // SLOT_ALIGN) * SLOT_ALIGN
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


class SlotPair:
    """Two reusable device buffers for one component's streamed units."""

    def __init__(self, sizes: list[int], device: torch.device):
        self.size, self.device = max(sizes, default=0), device
        # Allocated at the first load of a stage and dropped at its end: the planner counts the two slots in the
        # component's own stage only (the caching allocator keeps the memory for the next stage to reuse).
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.allocations = 0  # buffers allocated so far (two per stage that streams)
        self.holders: list[object | None] = [None, None]
        self._freed: list[torch.cuda.Event | None] = [None, None]  # compute stream: the last holder's block done
        self._turn = 0

    @property
    def live(self) -> int:
        """Slot buffers allocated now (at most two)."""
        return sum(b is not None for b in self.buffers)

    def drop(self) -> None:
        """Free both buffers (end of a stage); every copy into them was waited for by the compute stream."""
        if any(h is not None for h in self.holders):
            raise RuntimeError("a stream slot is dropped while a block still holds it")
        self.buffers = [None, None]
        self._freed = [None, None]

    def acquire(self, holder: object, stream: torch.cuda.Stream | None) -> int:
        """A free slot for `holder` (the slot not taken most recently first); the copy `stream` is made to wait
        until the compute stream is done with the slot's previous holder."""
        for index in (self._turn, 1 - self._turn):
            if self.holders[index] is None:
                break
        else:
            raise RuntimeError("both stream slots hold blocks: a third block was loaded before one was released")
        self.holders[index], self._turn = holder, 1 - index
        if self.buffers[index] is None:  # on the compute stream: its later reuse is ordered after every copy
            self.buffers[index] = torch.empty(self.size, dtype=torch.uint8, device=self.device)
            self.allocations += 1
        freed = self._freed[index]
        if freed is not None and stream is not None:
            stream.wait_event(freed)
        return index

    def release(self, index: int) -> None:
        """The holder's block has been issued on the compute stream; the slot may be refilled after it."""
        self.holders[index] = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._freed[index] = event

    def views(self, index: int, tensors: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
        """Slot `index` seen as tensors shaped like `tensors`, at `offsets` (from `slot_layout`)."""
        buffer = self.buffers[index]
        assert buffer is not None, "views of a slot that was not acquired"
        out = []
        for t, start in zip(tensors, offsets, strict=True):
            size = t.numel() * t.element_size()
            out.append(buffer[start : start + size].view(t.dtype).view(t.shape))
        return out
