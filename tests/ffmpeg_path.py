"""Hide the ffprobe/ffmpeg binaries from PATH lookups, so `h3serve.media.output_probe` reads with PyAV."""

from __future__ import annotations

import shutil

_which = shutil.which


def hide_ffmpeg(monkeypatch) -> None:
    """`shutil.which` finds no ffprobe/ffmpeg for the rest of the test (other names are still looked up)."""
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name in ("ffprobe", "ffmpeg") else _which(name))
