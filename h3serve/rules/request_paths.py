"""A path a request names (a control video under --control-dir, an adapter under --lora-dir), checked without
opening anything: inside the one directory the operator allows, within the filesystem's name limits.

Every way the check can fail is a `RequestError` naming the field: `..`, a path out of the root (symlinks
resolved), a component or a whole path longer than the filesystem allows (which would make `stat` raise
ENAMETOOLONG), and any other `OSError` or a NUL byte met while resolving it.
"""

from __future__ import annotations

import os
from pathlib import Path

from h3serve.errors import RequestError

_DEFAULT_NAME_MAX, _DEFAULT_PATH_MAX = 255, 4096  # Linux's NAME_MAX and PATH_MAX, where pathconf cannot say


def name_limits(root: Path) -> tuple[int, int]:
    """(longest component, longest path) in bytes on the filesystem of `root`."""
    limits = []
    for name, default in (("PC_NAME_MAX", _DEFAULT_NAME_MAX), ("PC_PATH_MAX", _DEFAULT_PATH_MAX)):
        try:
            limits.append(os.pathconf(root, name))
        except (OSError, ValueError):
            limits.append(default)
    return limits[0], limits[1]


def path_under(text: str, root: Path, field: str, directory: str) -> Path:
    """`text` (relative to `root`, or absolute inside it) as the resolved path inside `root`; `RequestError` on
    `field` otherwise. `directory` names the root in messages ("the control directory ... (--control-dir)")."""
    candidate = Path(text)
    name_max, path_max = name_limits(root)
    for part in candidate.parts:
        if len(os.fsencode(part)) > name_max:
            raise RequestError(field, f"a path component is {len(os.fsencode(part)):,} bytes; the filesystem "
                                      f"allows at most {name_max}")
    if len(os.fsencode(text)) > path_max:
        raise RequestError(field, f"the path is {len(os.fsencode(text)):,} bytes; at most {path_max}")
    if ".." in candidate.parts:
        raise RequestError(field, "must not contain '..'")
    full = candidate if candidate.is_absolute() else root / candidate
    try:
        real, real_root = Path(os.path.realpath(full)), Path(os.path.realpath(root))
    except (OSError, ValueError) as e:  # a NUL byte, a loop, a name the kernel refuses
        raise RequestError(field, f"cannot be resolved ({_why(e)})") from None
    if not real.is_relative_to(real_root):
        raise RequestError(field, f"is outside {directory}")
    return real


def is_file(path: Path, field: str) -> bool:
    """Whether `path` is a regular file; `RequestError` on `field` for an `OSError` other than "no such file"."""
    try:
        return path.is_file()
    except (OSError, ValueError) as e:
        raise RequestError(field, f"cannot be checked ({_why(e)})") from None


def _why(error: Exception) -> str:
    """The reason without the path (the server's own layout stays out of messages)."""
    return getattr(error, "strerror", None) or type(error).__name__
