"""Which LoRA adapters a server offers and how a request's `lora` field picks one (torch-free).

Preloaded adapters (`--lora-path NAME=PATH`) are chosen by name. A request's own `path` is read only under the
allow-listed root `--lora-dir`: without one, only preloaded names are accepted; `..`, a symlink leading out of
the root and an absolute path elsewhere are refused before anything is opened.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from h3serve.adapters import flashgen
from h3serve.adapters.header import AdapterError, read_header
from h3serve.adapters.pdd import VARIANTS as PDD_VARIANTS
from h3serve.adapters.pdd import inspect_pdd, is_pdd
from h3serve.adapters.peft import LoraFile, inspect_lora
from h3serve.adapters.turbo import TURBO_DEFAULT_ALPHA, check_key_format, parse_turbo_name, turbo_file_in
from h3serve.errors import ConfigError, RequestError
from h3serve.rules.adapter_choice import AdapterChoice, FlashGenContract, PddContract
from h3serve.rules.request_paths import path_under
from h3serve.rules.shown import shown

DEFAULT_SLOT_RANK = 128  # the released Turbo files' rank: what an allow-listed directory may bring
SCALE_LIMIT = 10.0
INT_ID_MAX = 2**63 - 1  # lora_int_id: stored with the job as a 64-bit integer
PEFT_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraField:
    """The request field `lora` as the client sent it (vLLM-Omni's names and aliases resolved)."""

    name: str | None = None
    path: str | None = None
    scale: float | None = None
    int_id: int | None = None


def adapter_file(path: Path) -> Path:
    """The .safetensors file of an adapter path: the file itself, or a directory's one Turbo file, one released PDD
    file or adapter_model.safetensors."""
    if path.is_dir():
        turbo = turbo_file_in(path)
        if turbo is not None:
            return turbo
        pdd = [path / name for _, name in PDD_VARIANTS.values() if (path / name).is_file()]
        if len(pdd) > 1:
            raise AdapterError(f"{path.name}: holds both PDD files; name the one to use (they serve different DiTs)")
        if pdd:
            return pdd[0]
        if (path / PEFT_FILE).is_file():
            return path / PEFT_FILE
        if (path / flashgen.RELEASED_FILE).is_file():
            return path / flashgen.RELEASED_FILE
        raise AdapterError(f"{path.name}: the directory holds no Turbo adapter file, no released PDD or FlashGen file "
                           f"and no {PEFT_FILE}")
    if not path.is_file():
        raise AdapterError(f"{path.name}: no such adapter file or directory")
    if path.suffix != ".safetensors":
        raise AdapterError(f"{path.name}: an adapter is a .safetensors file")
    return path


Contract = PddContract | FlashGenContract  # what a special adapter promises beside its factors


def read_adapter(
    path: str | Path, dit_config: dict | None, shapes: dict[str, tuple[int, int]],
    log: Callable[[str], None] | None = None,
) -> tuple[LoraFile, Contract | None]:
    """Check an adapter file or directory against the DiT: a PDD file (a head bank), a FlashGen LoRA (native keys,
    its metadata's base schedule) — both need `dit_config`, the DiT's config —, else a LoRA (`lora_file`)."""
    file = adapter_file(Path(path))
    header = read_header(file)
    special = "PDD" if is_pdd(header) else "FlashGen" if flashgen.claims(header) else None
    if special is not None and dit_config is None:
        raise AdapterError(f"{file.name}: a {special} file, which this check cannot read without the DiT's config")
    if special == "PDD":
        pdd = inspect_pdd(header, dit_config)
        return pdd.lora, pdd.contract
    if special == "FlashGen":
        found = flashgen.inspect_flashgen(header, dit_config)
        return found.lora, found.contract
    return lora_file(file, shapes, log), None


def lora_file(
    path: str | Path, shapes: dict[str, tuple[int, int]], log: Callable[[str], None] | None = None
) -> LoraFile:
    """Check an adapter file or directory against the DiT's targets; a Turbo name adds its own rules."""
    file = adapter_file(Path(path))
    header = read_header(file)
    turbo = parse_turbo_name(file.name)
    if turbo is not None:
        check_key_format(turbo, header.metadata)
    info = inspect_lora(header, shapes, TURBO_DEFAULT_ALPHA if turbo is not None else None)
    if turbo is not None and info.alpha_source == "default" and log is not None:
        log(f"warning: {file.name}: no alpha in its metadata; using LightX2V's default alpha {TURBO_DEFAULT_ALPHA:g}")
    return info


def guard_path(text: str, root: Path | None) -> Path:
    """`text` as a path inside the allow-listed `root`, without opening anything; `RequestError` otherwise."""
    if root is None:
        raise RequestError(
            "lora.path", "this server reads no adapter paths (it was started without --lora-dir); use a preloaded name"
        )
    return path_under(text, root, "lora.path", "the adapter directory the server allows (--lora-dir)")


def default_int_id(path: str) -> int:
    return zlib.crc32(path.encode()) & 0x7FFFFFFF


def _stderr(text: str) -> None:
    print(text, file=sys.stderr)


class LoraCatalog:
    """The adapters a server offers: preloaded ones by name, and files under `root` by path."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, int]],
        preloaded: Mapping[str, str] | None = None,
        default_scale: float = 1.0,
        root: Path | None = None,
        max_rank: int | None = None,
        log: Callable[[str], None] = _stderr,
        dit_config: dict | None = None,  # the DiT's config.json: what a PDD file is checked against
    ):
        self.shapes = shapes
        self.dit_config = dit_config
        self.default_scale = default_scale
        self.root = root
        self.log = log
        self.preloaded: dict[str, AdapterChoice] = {}
        for name, path in (preloaded or {}).items():
            try:
                self.preloaded[name] = self._choice(name, Path(path), default_scale, None)
            except AdapterError as e:
                raise AdapterError(f"--lora-path {name}={path}: {e}") from None
        ranks = [c.rank for c in self.preloaded.values()]
        self.slot_rank = max_rank or max([*ranks, DEFAULT_SLOT_RANK if root is not None else 0]) or 0
        too_big = [f"{c.name} (rank {c.rank})" for c in self.preloaded.values() if c.rank > self.slot_rank]
        if too_big:
            raise AdapterError(f"--max-lora-rank {self.slot_rank}: smaller than {', '.join(too_big)}")

    @property
    def enabled(self) -> bool:
        return bool(self.preloaded) or self.root is not None

    def _choice(self, name: str, path: Path, scale: float, int_id: int | None) -> AdapterChoice:
        info, contract = read_adapter(path, self.dit_config, self.shapes, self.log)
        turbo = None if contract is not None else parse_turbo_name(info.path.name)
        file = str(info.path)
        chosen_id = default_int_id(file) if int_id is None else int_id
        pdd = contract if isinstance(contract, PddContract) else None
        fg = contract if isinstance(contract, FlashGenContract) else None
        return AdapterChoice(name, file, scale, chosen_id, info.rank, info.alpha, turbo, pdd, fg)

    def choose(self, field: LoraField) -> AdapterChoice:
        """Resolve a request's `lora` field; `RequestError` naming the sub-field."""
        if not self.enabled:
            raise RequestError("lora", "this server serves no LoRA adapters (start it with --lora-path or --lora-dir)")
        if field.path is None:
            if field.name is None:
                raise RequestError("lora", "give a name (a preloaded adapter) or a path")
            if field.name not in self.preloaded:
                known = ", ".join(sorted(self.preloaded)) or "none"
                raise RequestError("lora.name", f"unknown adapter {shown(field.name)}; preloaded: {known}")
            choice = self.preloaded[field.name]
            scale = choice.scale if field.scale is None else field.scale
            int_id = choice.int_id if field.int_id is None else field.int_id
            return dataclasses.replace(choice, scale=scale, int_id=int_id)
        path = guard_path(field.path, self.root)
        scale = self.default_scale if field.scale is None else field.scale
        try:
            choice = self._choice(field.name or path.stem, path, scale, field.int_id)
        except AdapterError as e:
            raise RequestError("lora.path", str(e)) from None
        except OSError as e:  # reading under the root failed (a name the kernel refuses, I/O): never the path
            raise RequestError("lora.path", f"cannot be read ({e.strerror or type(e).__name__})") from None
        if choice.rank > self.slot_rank:
            raise RequestError("lora.path", f"adapter rank {choice.rank} exceeds this server's {self.slot_rank}")
        return choice

    def models(self, root_model: str, created: int) -> list[dict]:
        """The preloaded adapters as vLLM lists LoRA modules in GET /v1/models."""
        def turbo(choice: AdapterChoice) -> dict:
            if choice.flashgen is not None:
                fg = choice.flashgen
                return {"flashgen": {"forwards": fg.forwards, "tasks": list(fg.tasks),
                                     "base_schedule": list(fg.positions), "applied": "unmerged"}}
            if choice.pdd is not None:
                return {"pdd": {"forwards": choice.pdd.forwards, "tasks": list(choice.pdd.tasks)}}
            if choice.turbo is None:
                return {}
            return {"turbo": {"forwards": choice.turbo.forwards, "tasks": list(choice.turbo.tasks)}}

        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "h3serve",
                "root": choice.path,
                "parent": root_model,
                "permission": [],
                "lora": {"int_id": choice.int_id, "rank": choice.rank, "alpha": choice.alpha, "scale": choice.scale},
                **turbo(choice),
            }
            for name, choice in sorted(self.preloaded.items())
        ]


_NAME_KEYS = ("name", "lora_name", "adapter")
_PATH_KEYS = ("path", "lora_path", "local_path")
_SCALE_KEYS = ("scale", "lora_scale")
_ID_KEYS = ("int_id", "lora_int_id")


def _one(value: dict, keys: tuple[str, ...]) -> object:
    present = [k for k in keys if value.get(k) is not None]
    if len(present) > 1 and len({repr(value[k]) for k in present}) > 1:
        raise RequestError("lora", f"{' and '.join(present)} disagree; give one of them")
    return value[present[0]] if present else None


def parse_lora_field(value: object) -> LoraField | None:
    """vLLM-Omni's `lora` object: {name|lora_name|adapter, path|lora_path|local_path, scale|lora_scale,
    int_id|lora_int_id}; None / {} means no adapter."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("lora", f"must be an object with name and/or path, got {type(value).__name__}")
    known = set(_NAME_KEYS + _PATH_KEYS + _SCALE_KEYS + _ID_KEYS)
    unknown = sorted(k for k in value if k not in known)
    if unknown:
        raise RequestError("lora", f"unknown keys {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    if not value:
        return None
    name, path, scale, int_id = (_one(value, keys) for keys in (_NAME_KEYS, _PATH_KEYS, _SCALE_KEYS, _ID_KEYS))
    for field, text in (("lora.name", name), ("lora.path", path)):
        if text is not None and (not isinstance(text, str) or not text or "\x00" in text or len(text) > 4096):
            raise RequestError(field, "must be a non-empty string of at most 4096 characters")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise RequestError("lora.scale", f"must be a number, got {shown(scale)}")
        if abs(scale) > SCALE_LIMIT:
            raise RequestError("lora.scale", f"must be between -{SCALE_LIMIT:g} and {SCALE_LIMIT:g}, "
                                             f"got {shown(scale)}")
    if int_id is not None and (isinstance(int_id, bool) or not isinstance(int_id, int)
                               or not 0 <= int_id <= INT_ID_MAX):
        raise RequestError("lora.int_id", f"must be an integer from 0 to {INT_ID_MAX}, got {shown(int_id)}")
    if name is None and path is None:
        raise RequestError("lora", "give a name (a preloaded adapter) or a path")
    return LoraField(name, path, None if scale is None else float(scale), int_id)


def parse_lora_paths(values: list[str]) -> tuple[tuple[str, str], ...]:
    """`--lora-path NAME=PATH` (or just PATH: named by its file or folder stem) values, names unique."""
    out: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = Path(value).stem, value
        if not name or not path:
            raise ConfigError(f"--lora-path {value}: give NAME=PATH")
        if name in out:
            raise ConfigError(f"--lora-path: the name {name} is given twice")
        out[name] = path
    return tuple(out.items())
