"""One server per data dir: an exclusive `flock` on `<data_dir>/.lock`, held for the server's lifetime.

Two servers on one data dir would run each other's queued jobs and sweep each other's files. The kernel
drops the lock when its holder exits, however it exits, so a crashed server never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from h3serve.errors import ServerError

LOCK_NAME = ".lock"


class DataDirBusy(ServerError, RuntimeError):
    """Another process holds the data dir's lock."""

    code = "data_dir_busy"


def _holder(fd: int) -> str:
    """" (pid N)" from the pid the holder wrote into the lock file; "" if unreadable."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""


class DataDirLock:
    """`acquire` takes the lock or fails at once; `release` (or leaving the `with` block) lets it go."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Create the folder if need be and lock it. `DataDirBusy` if another process holds the lock,
        `OSError` if the folder is unusable."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inheritable (PEP 446): ranks never hold it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            message = f"{self.data_dir} is in use by another h3serve server{_holder(fd)}"
            os.close(fd)
            raise DataDirBusy(message) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # only for the message a second server prints
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __enter__(self) -> DataDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
