"""Lossless, byte-reproducible storage of raw model output (video + audio arrays) as ``.npz``.

Also holds the input validation and the atomic-write helper shared with :mod:`h3serve.media.mp4`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

PathLike = str | os.PathLike[str]

# A fixed timestamp for every zip entry (the earliest a zip can hold), so output bytes never depend on the clock.
_ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_RAW_KEYS = ("video", "audio", "fps", "sample_rate")


def validate_media(
    video: np.ndarray, audio: np.ndarray, fps: int, sample_rate: int, *, even_dims: bool = False
) -> None:
    """Raise ValueError unless ``video`` is float32 [T,H,W,3] and ``audio`` is float32 [2,N].

    ``even_dims`` additionally requires even H and W (needed by yuv420p chroma subsampling).
    """
    if not isinstance(video, np.ndarray):
        raise ValueError(f"video must be a numpy array, got {type(video).__name__}")
    if not isinstance(audio, np.ndarray):
        raise ValueError(f"audio must be a numpy array, got {type(audio).__name__}")
    if video.dtype != np.float32:
        raise ValueError(f"video must be float32, got {video.dtype}")
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"video must have shape [T, H, W, 3] (RGB), got {list(video.shape)}")
    t, h, w, _ = video.shape
    if t < 1 or h < 1 or w < 1:
        raise ValueError(f"video must be non-empty, got shape {list(video.shape)}")
    if even_dims and (h % 2 or w % 2):
        raise ValueError(f"yuv420p needs even width and height, got {w}x{h} (W x H)")
    if audio.dtype != np.float32:
        raise ValueError(f"audio must be float32, got {audio.dtype}")
    if audio.ndim != 2 or audio.shape[0] != 2:
        raise ValueError(f"audio must have shape [2, N] (stereo, channels first), got {list(audio.shape)}")
    for name, value in (("fps", fps), ("sample_rate", sample_rate)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@contextlib.contextmanager
def atomic_output(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success fsync it and ``os.replace`` it onto ``path``.

    On error the temporary file is removed and ``path`` is left untouched.
    """
    final = Path(path)
    tmp = final.with_name(f".{final.name}.{secrets.token_hex(6)}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # make the rename durable; not possible on every platform
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _npy_entry(zf: zipfile.ZipFile, name: str, array: np.ndarray) -> None:
    info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_DATE_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 3  # Unix; the default depends on the platform writing the file
    info.external_attr = 0o644 << 16
    with zf.open(info, "w", force_zip64=array.nbytes > 2**31 - 2**20) as f:
        if not array.flags.c_contiguous:  # one canonical layout (ascontiguousarray would make 0-d arrays 1-d)
            array = array.copy(order="C")
        np.lib.format.write_array(f, array, allow_pickle=False)


def write_raw(path: PathLike, video: np.ndarray, audio: np.ndarray, fps: int = 24, sample_rate: int = 32000) -> None:
    """Write ``video`` float32 [T,H,W,3] and ``audio`` float32 [2,N] losslessly to an ``.npz`` at ``path``.

    Identical inputs give identical bytes (fixed zip timestamps); the write is atomic. ``np.load`` reads it.
    """
    validate_media(video, audio, fps, sample_rate)
    with atomic_output(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
        _npy_entry(zf, "video", video)
        _npy_entry(zf, "audio", audio)
        _npy_entry(zf, "fps", np.asarray(fps, dtype=np.int64))
        _npy_entry(zf, "sample_rate", np.asarray(sample_rate, dtype=np.int64))


def read_raw(path: PathLike) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Read a file written by :func:`write_raw`: ``(video, audio, fps, sample_rate)``."""
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in _RAW_KEYS if k not in data.files]
            if missing:
                raise ValueError(f"{path}: not a raw media file, missing entries {missing}")
            video, audio = data["video"], data["audio"]
            fps, sample_rate = int(data["fps"]), int(data["sample_rate"])
    except FileNotFoundError:
        raise
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: cannot read raw media file: {e}") from e
    validate_media(video, audio, fps, sample_rate)
    return video, audio, fps, sample_rate


def write_chunk(path: PathLike, frames: np.ndarray, audio: np.ndarray) -> None:
    """A real-time chunk's media for the parent: uint8 frames [T, H, W, 3] and float32 audio [S, 2] (T, S may be 0).
    A transient hand-over (the parent reads and removes it once the rank's message names it): renamed into place,
    not synced to disk."""
    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, frames=np.ascontiguousarray(frames, dtype=np.uint8), audio=np.ascontiguousarray(audio, np.float32))
    os.replace(tmp, path)


def read_chunk(path: PathLike) -> tuple[np.ndarray, np.ndarray]:
    """(frames, audio) of a file `write_chunk` wrote."""
    with np.load(path) as data:
        return data["frames"], data["audio"]
