"""File helpers of the tiny checkpoint builders: JSON, an exclusive lock, quiet saves, modes, atomic replacement."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    with open(path, "a", encoding="utf-8") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' "Writing model shards" progress bars."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def make_readable(root: Path) -> None:
    """Give every file mode 0644 and every folder 0755 (safetensors writes its files 0600)."""
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)


def replace_dir(source: Path, target: Path) -> None:
    """Move ``source`` to ``target``; a stale ``target`` (incomplete or outdated) is moved aside first."""
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".stale", dir=target.parent))
        os.rename(target, stale / target.name)
        os.rename(source, target)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(source, target)
