"""The benchmark matrix: tasks x shapes x engine configs, from a YAML file and/or flags, checked once.

Engine options are exactly `EngineConfig`'s fields (minus `model`): a new engine feature (offload, cache,
compile, ...) becomes a matrix option by adding the field there, with no change here.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from h3serve.config.engine_config import EngineConfig, warmup_shapes
from h3serve.config.offload_config import (
    OffloadConfig,
    OffloadError,
    OffloadFlags,
    offload_config_from_flags,
    parse_bytes,
)
from h3serve.config.quantization_config import GRANULARITIES, QuantizationError, parse_quantization
from h3serve.errors import ServerError
from h3serve.rules.names import TASKS

PEERS = ("diffusers",)
PROMPT_CACHE_MODES = ("cold", "warm")
SIDE = "h3serve"
DEFAULT_PROMPT = "A red fox trots through fresh snow at dawn, its paws crunching softly."


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


class MatrixError(ServerError, ValueError):
    """A malformed matrix; the message names the key and the fix."""

    code = "invalid_config"


def engine_option_defaults() -> dict[str, Any]:
    """EngineConfig's options with their defaults (the names a matrix may set)."""
    return {
        f.name: f.default if f.default is not MISSING else f.default_factory()
        for f in fields(EngineConfig)
        if f.name != "model" and (f.default is not MISSING or f.default_factory is not MISSING)
    }


@dataclass(frozen=True)
class Shape:
    width: int
    height: int
    num_frames: int

    @property
    def label(self) -> str:
        return f"{self.width}x{self.height}x{self.num_frames}"

    @classmethod
    def parse(cls, value: Any) -> Shape:
        """'448x256x124' or {width, height, num_frames}."""
        if isinstance(value, str):
            m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*", value)
            if not m:
                raise MatrixError(f"shape: expected WIDTHxHEIGHTxFRAMES such as 448x256x124, got {value!r}")
            return cls(*(int(g) for g in m.groups()))
        if isinstance(value, dict):
            _check_keys("shape", value, {"width", "height", "num_frames"}, required=True)
            if not all(isinstance(value[k], int) and not isinstance(value[k], bool) for k in value):
                raise MatrixError(f"shape: width, height and num_frames must be integers, got {value}")
            return cls(value["width"], value["height"], value["num_frames"])
        raise MatrixError(f"shape: expected a string or a mapping, got {value!r}")


@dataclass(frozen=True)
class EngineSpec:
    """One engine configuration: a name and EngineConfig options (validated, typed)."""

    name: str
    options: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    lora: str | None = None  # a preloaded adapter (lora_paths) every request of this engine names


    @classmethod
    def parse(cls, value: Any, index: int) -> EngineSpec:
        """A mapping ({name: fp32, threads: 2}) or a flag string ('name=fp32,threads=2')."""
        if isinstance(value, str):
            items: dict[str, Any] = {}
            for part in filter(None, (p.strip() for p in value.split(","))):
                key, sep, text = part.partition("=")
                if not sep:
                    raise MatrixError(f"engine: expected key=value pairs separated by commas, got {part!r}")
                items[key.strip().replace("-", "_")] = text.strip()
            value = items
        if not isinstance(value, dict):
            raise MatrixError(f"engine: expected a mapping or 'key=value,...', got {value!r}")
        value = dict(value)
        name = str(value.pop("name", "") or f"engine{index}")
        lora = value.pop("lora", None)
        defaults = engine_option_defaults()
        _check_keys("engine option", value, set(defaults) | {"lora"})
        special = ("quantization", "lora_paths")
        options = {k: _coerce(k, v, defaults[k]) for k, v in value.items() if k not in special}
        if "lora_paths" in value:  # "NAME=PATH" items (a list in YAML, ';'-separated in a flag)
            options["lora_paths"] = _lora_paths(value["lora_paths"])
        if "quantization" in value:  # kept as written (it goes into the JSON records), checked here
            _quantization(value["quantization"])
            options["quantization"] = value["quantization"]
        if lora is not None and lora not in dict(options.get("lora_paths", ())):
            raise MatrixError(f"engine {name}: lora {lora!r} is not one of its lora_paths names")
        return cls(name=name, options=MappingProxyType(dict(sorted(options.items()))), lora=lora)

    def config(self, model: Path) -> EngineConfig:
        options = dict(self.options)
        if "quantization" in options:
            options["quantization"] = _quantization(options["quantization"])
        return EngineConfig(model=model, **options)


@dataclass(frozen=True)
class BenchCase:
    task: str
    shape: Shape
    engine: EngineSpec

    @property
    def id(self) -> str:
        return f"{self.task}-{self.shape.label}-{self.engine.name}"


@dataclass(frozen=True)
class BenchMatrix:
    model: str | None = None  # checkpoint folder; None: the tiny checkpoint of `preset`
    preset: str = "tiny"
    prompt: str = DEFAULT_PROMPT
    seed: int = 0
    steps: int = 3  # denoiser forwards (the diffusers peer is called with steps + 1 sigma points)
    warmup: int = 1
    runs: int = 3
    tasks: tuple[str, ...] = ("t2va",)
    shapes: tuple[Shape, ...] = ()  # empty: the checkpoint's default canvas at 124 frames
    engines: tuple[EngineSpec, ...] = (EngineSpec("default"),)
    peer: str | None = None
    profile: bool = False
    # cold: every h3serve run starts with an empty prompt cache, so a warm-up of the same prompt cannot hide the text
    # encode; warm: the cache stays (repeated prompts skip the encoder, as on a server)
    prompt_cache: str = "cold"
    reference: str = "auto"  # auto (peer if given, else first) | peer | first | a .mp4/.npz file
    gemm_seconds: float = 3.0  # time budget of each GEMM peak measurement (one before, one after each case)

    def cases(self) -> list[BenchCase]:
        return [BenchCase(t, s, e) for e, t, s in itertools.product(self.engines, self.tasks, self.shapes)]

    def check(self) -> BenchMatrix:
        """Fail on any illegal value; resolves `reference: auto`."""
        for task in self.tasks:
            if task not in TASKS:
                raise MatrixError(f"tasks: unknown task {task!r}; choose from: {', '.join(TASKS)}")
        if self.prompt_cache not in PROMPT_CACHE_MODES:
            raise MatrixError(f"prompt_cache: expected {' or '.join(PROMPT_CACHE_MODES)}, got {self.prompt_cache!r}")
        if self.peer is not None and self.peer not in PEERS:
            raise MatrixError(f"peer: unknown peer {self.peer!r}; choose from: {', '.join(PEERS)}")
        if not self.gemm_seconds > 0:
            raise MatrixError(f"gemm_seconds: must be > 0, got {self.gemm_seconds}")
        for key in ("steps", "runs"):
            if getattr(self, key) < 1:
                raise MatrixError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.warmup < 0:
            raise MatrixError(f"warmup: must be >= 0, got {self.warmup}")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names) or not names:
            raise MatrixError(f"engines: names must be unique and at least one given, got {names}")
        reference = self.reference
        if reference == "auto":
            reference = "peer" if self.peer else "first"
        if reference == "peer" and not self.peer:
            raise MatrixError("reference: 'peer' needs a peer (--peer diffusers)")
        if reference not in ("peer", "first") and not Path(reference).is_file():
            raise MatrixError(f"reference: expected peer, first or an existing .mp4/.npz file, got {reference!r}")
        return replace(self, reference=reference)


_MATRIX_KEYS = {f.name for f in fields(BenchMatrix)}


def _quantization(value: Any):
    """`quantization=fp8 | per_channel | per_tensor` (FP8 with those scales), or in YAML a mapping in the
    `--diffusion-quantization-config` JSON form."""
    if isinstance(value, str) and value in GRANULARITIES:
        value = {"granularity": value}
    try:
        if isinstance(value, dict):
            return parse_quantization("fp8", json.dumps(value))
        if value == "fp8":
            return parse_quantization("fp8", None)
    except QuantizationError as e:
        raise MatrixError(f"engine option quantization: {e}") from None
    choices = ", ".join(("fp8", *GRANULARITIES))
    raise MatrixError(f"engine option quantization: expected {choices} or a mapping, got {value!r}")


def _lora_paths(value: Any) -> tuple[tuple[str, str], ...]:
    from h3serve.adapters.catalog import parse_lora_paths
    from h3serve.errors import ConfigError

    items = value.split(";") if isinstance(value, str) else list(value)
    try:
        return parse_lora_paths([str(v) if isinstance(v, str) else f"{v[0]}={v[1]}" for v in items])
    except (ConfigError, IndexError, TypeError) as e:
        raise MatrixError(f"engine option lora_paths: {e}") from None


def _check_keys(what: str, data: dict, allowed: set[str], required: bool = False) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise MatrixError(f"unknown {what} key(s) {', '.join(unknown)}; choose from: {', '.join(sorted(allowed))}")
    if required and set(data) != allowed:
        raise MatrixError(f"{what}: missing {', '.join(sorted(allowed - set(data)))}")


def _offload(value: Any) -> OffloadConfig:
    """`offload`: the compact form of --diffusion-offload-config, as a mapping or its JSON text."""
    text = value if isinstance(value, str) else json.dumps(value)
    try:
        return offload_config_from_flags(OffloadFlags(diffusion_offload_config=text))
    except OffloadError as e:
        raise MatrixError(f"engine option offload: {e}") from None


def _adaln_memo(value: Any) -> int | None:
    """`adaln_memo_bytes`: bytes, a size such as 4GiB, or off / null (each forward computes its modulations)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    try:
        return parse_bytes(str(value), "adaln_memo_bytes")
    except OffloadError as e:
        raise MatrixError(f"engine option {e} (or off)") from None


def _warmup(value: Any) -> tuple[str, ...]:
    """`warmup`: shapes the engine runs before its first request ("default", WxHxFRAMES; a list, or one
    comma-separated string), or off / an empty list (none): what `serve --warmup` does."""
    if value is None or value == []:
        return ()
    return warmup_shapes(value if isinstance(value, str) else ",".join(str(v) for v in value))


_SPECIAL = {"offload": _offload, "adaln_memo_bytes": _adaln_memo, "warmup": _warmup}  # not plain scalars


def _coerce(key: str, value: Any, default: Any) -> Any:
    """A flag string or YAML value -> the type of the EngineConfig default (as given when the default is None)."""
    if key in _SPECIAL:
        return _SPECIAL[key](value)
    if default is None:
        return value
    kind = type(default)
    if kind not in _TYPE_NAMES:
        raise MatrixError(f"engine option {key}: options of type {kind.__name__} cannot be set from a matrix yet")
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        try:
            if kind is bool:
                if text not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return text in ("true", "1", "yes")
            return kind(text)
        except ValueError:
            raise MatrixError(f"engine option {key}: expected {_TYPE_NAMES[kind]}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MatrixError(f"engine option {key}: expected {_TYPE_NAMES[kind]}, got {value!r}")
    return value


def _as_tuple(key: str, value: Any) -> tuple:
    if isinstance(value, list | tuple):
        return tuple(value)
    if value is None:
        raise MatrixError(f"{key}: must not be empty")
    return (value,)


def matrix_from_dict(data: dict[str, Any]) -> BenchMatrix:
    """Build from a parsed YAML mapping (or the flags' overrides); unknown keys are refused."""
    if not isinstance(data, dict):
        raise MatrixError(f"the matrix must be a mapping, got {type(data).__name__}")
    _check_keys("matrix", data, _MATRIX_KEYS)
    values = dict(data)
    if "tasks" in values:
        values["tasks"] = tuple(str(t) for t in _as_tuple("tasks", values["tasks"]))
    if "shapes" in values:
        values["shapes"] = tuple(Shape.parse(s) for s in _as_tuple("shapes", values["shapes"]))
    if "engines" in values:
        values["engines"] = tuple(EngineSpec.parse(e, i) for i, e in enumerate(_as_tuple("engines", values["engines"])))
    if isinstance(values.get("gemm_seconds"), int) and not isinstance(values["gemm_seconds"], bool):
        values["gemm_seconds"] = float(values["gemm_seconds"])
    types = {"seed": int, "steps": int, "warmup": int, "runs": int, "profile": bool, "gemm_seconds": float}
    for key, kind in types.items():
        if key in values and (not isinstance(values[key], kind) or (kind is int and isinstance(values[key], bool))):
            raise MatrixError(f"{key}: expected {_TYPE_NAMES[kind]}, got {values[key]!r}")
    for key in ("model", "preset", "prompt", "peer", "reference", "prompt_cache"):
        if key in values and values[key] is not None:
            values[key] = str(values[key])
    return BenchMatrix(**values)


def load_matrix(path: str | Path | None, overrides: dict[str, Any]) -> BenchMatrix:
    """The YAML file's matrix (if any) with flag overrides (None values ignored) applied on top."""
    import yaml

    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as e:
            raise MatrixError(f"--matrix: cannot read {path}: {e}") from None
        if not isinstance(data, dict):
            raise MatrixError(f"--matrix: {path} must hold a mapping of matrix keys")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return matrix_from_dict(data).check()
