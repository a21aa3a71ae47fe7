"""release_free_heap: freed heap pages go back to the OS, so they no longer count in the resident set."""

from __future__ import annotations

import psutil

from h3serve.offload.host_heap import release_free_heap


def test_freed_heap_chunks_leave_the_resident_set():
    # 64 KiB chunks sit below glibc's mmap threshold: they come from the heap, and freeing every other one
    # leaves holes that free() alone keeps (they are not at the heap's top).
    chunks = [bytearray(b"x" * 65536) for _ in range(2048)]  # 128 MiB, touched
    del chunks[::2]
    before = psutil.Process().memory_info().rss
    assert release_free_heap()  # Linux with glibc: this suite's platform
    after = psutil.Process().memory_info().rss
    assert before - after > 32 * 2**20  # most of the 64 MiB of holes
    assert len(chunks) == 1024
