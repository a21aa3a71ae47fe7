"""LightX2V Turbo LoRAs: the file name is the contract (task family, forward count, flow shifts).

`minimax_h3_(fl2v|ref2v)_turbo_<N>step_v<major.minor>[_768p][_bf16].safetensors`: `fl2v` serves t2va and fl2va,
`ref2v` serves ref2va; N is the number of denoiser forwards; the video flow shift is 6 for `_768p` files and 12
otherwise, the audio shift 3. Alpha comes from the metadata, else LightX2V's default 8 (with a warning).
"""

from __future__ import annotations

import re
from pathlib import Path

from h3serve.adapters.header import AdapterError
from h3serve.rules.adapter_choice import TurboContract

TURBO_NAME = re.compile(r"^minimax_h3_(fl2v|ref2v)_turbo_(\d+)step_v(\d+\.\d+)(_768p)?(_bf16)?\.safetensors$")
TURBO_DEFAULT_ALPHA = 8.0
KEY_FORMATS = (None, "minimax-h3-diffusers")


def parse_turbo_name(name: str) -> TurboContract | None:
    """The contract of a Turbo file name, or None when the name is not one."""
    m = TURBO_NAME.match(name)
    if m is None:
        return None
    forwards = int(m[2])
    if forwards < 1:
        raise AdapterError(f"{name}: a Turbo adapter runs at least 1 forward, the name says {forwards}")
    return TurboContract(name, m[1], forwards, m[3], 6.0 if m[4] else 12.0)


def turbo_file_in(folder: Path) -> Path | None:
    """The one Turbo file of a directory; None when it holds none, `AdapterError` when it holds several."""
    found = sorted(p for p in folder.iterdir() if TURBO_NAME.match(p.name) and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise AdapterError(f"{folder.name}: a Turbo adapter directory holds exactly one matching file, found {names}")
    return found[0] if found else None


def check_key_format(contract: TurboContract, metadata: dict[str, str]) -> None:
    fmt = metadata.get("key_format")
    if fmt not in KEY_FORMATS:
        raise AdapterError(f"{contract.file_name}: metadata key_format {fmt!r}; expected minimax-h3-diffusers")
