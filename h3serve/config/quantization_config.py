"""`--quantization fp8` and `--diffusion-quantization-config`: which components' linears become FP8, how their
scales are laid out, and which kernel path is asked for. Parsed and checked once; no torch here (the parent
side builds the EngineConfig that carries it).

JSON (every key optional; a component not named keeps the `--quantization fp8` default, on):
  {"method": "fp8", "granularity": "per_channel" | "per_tensor", "kernel": "auto" | "weight_only" | "fp8_gemm",
   "dit": true | false | {"granularity": ..., "exclude": ["transformer_blocks.0.*"], "adaln": false},
   "dit_ref": ..., "text_encoder": ...}

Quantised by default (module-name patterns, fnmatch, on linear layers only):
  DiT: the text-condition projection, every refiner and main block's attention (q/k/v/out) and both FFN
  projections; with `"adaln": true` also the per-block AdaLN projections and the output norm's projection.
  Kept in their dtype: the video/audio patch projections, the time embedder, the video/audio heads, every norm.
  Text encoder: every decoder layer's attention and MLP linears; the embeddings and the vision tower are kept.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from h3serve.errors import ServerError

METHODS = ("fp8",)
GRANULARITIES = ("per_channel", "per_tensor")
KERNELS = ("auto", "weight_only", "fp8_gemm")
# The config's component names -> the checkpoint components they quantise.
COMPONENTS = {"dit": "transformer", "dit_ref": "transformer_ref", "text_encoder": "text_encoder"}
_DIT_FIELDS = ("granularity", "exclude", "adaln")
_TEXT_FIELDS = ("granularity", "exclude")

DIT_QUANTIZED = (
    "context_embedder",
    "token_refiner.refiner_blocks.*.attn.to_[qkv]",
    "token_refiner.refiner_blocks.*.attn.to_out.0",
    "token_refiner.refiner_blocks.*.ff.net.0.proj",
    "token_refiner.refiner_blocks.*.ff.net.2",
    "transformer_blocks.*.attn.to_[qkv]",
    "transformer_blocks.*.attn.to_out.0",
    "transformer_blocks.*.ff.net.0.proj",
    "transformer_blocks.*.ff.net.2",
)
DIT_ADALN = ("transformer_blocks.*.adaln_proj.linear", "norm_out.linear")
TEXT_QUANTIZED = (
    "language_model.layers.*.self_attn.[qkvo]_proj",
    "language_model.layers.*.mlp.gate_proj",
    "language_model.layers.*.mlp.up_proj",
    "language_model.layers.*.mlp.down_proj",
)


class QuantizationError(ServerError, ValueError):
    """A bad quantization flag or JSON; the message names the key and the choices."""


@dataclass(frozen=True)
class ComponentQuant:
    """How one component's linears are quantised."""

    granularity: str = "per_channel"  # one scale per output channel, or one per tensor
    exclude: tuple[str, ...] = ()  # module-name patterns kept in their dtype
    adaln: bool = False  # DiT only: the AdaLN projections too

    @property
    def per_channel(self) -> bool:
        return self.granularity == "per_channel"

    def patterns(self, component: str) -> tuple[str, ...]:
        """The module-name patterns quantised in `component` (a checkpoint component name)."""
        if component == "text_encoder":
            return TEXT_QUANTIZED
        return DIT_QUANTIZED + (DIT_ADALN if self.adaln else ())

    def selects(self, component: str, module_name: str) -> bool:
        """Whether the linear `module_name` of `component` is quantised."""
        if any(fnmatch.fnmatchcase(module_name, p) for p in self.exclude):
            return False
        return any(fnmatch.fnmatchcase(module_name, p) for p in self.patterns(component))

    def check_excludes(self, component: str, linear_names: Iterable[str]) -> None:
        """`QuantizationError` for an exclude pattern that matches none of the linears this component would
        quantise (a typo would otherwise silently quantise what was meant to be kept)."""
        chosen = [n for n in linear_names if any(fnmatch.fnmatchcase(n, p) for p in self.patterns(component))]
        for pattern in self.exclude:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in chosen):
                example = chosen[0] if chosen else "none"
                raise QuantizationError(
                    f"--diffusion-quantization-config: {_config_name(component)}.exclude pattern {pattern!r} matches "
                    f"none of its {len(chosen)} quantised linears (names look like {example!r})"
                )


@dataclass(frozen=True)
class QuantizationConfig:
    """FP8 for the named checkpoint components (`transformer`, `transformer_ref`, `text_encoder`)."""

    method: str = "fp8"
    kernel: str = "auto"
    components: tuple[tuple[str, ComponentQuant], ...] = field(
        default_factory=lambda: tuple((c, ComponentQuant()) for c in COMPONENTS.values())
    )

    def component(self, name: str) -> ComponentQuant | None:
        """The settings of checkpoint component `name`, or None when it stays in full precision."""
        return dict(self.components).get(name)

    def describe(self) -> str:
        parts = [f"{name} ({q.granularity}{', adaln' if q.adaln else ''})" for name, q in self.components]
        return f"{self.method}: " + (", ".join(parts) or "no component")


def _config_name(component: str) -> str:
    return next((k for k, v in COMPONENTS.items() if v == component), component)


def _choice(where: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise QuantizationError(
            f"--diffusion-quantization-config: {where} {value!r}; choose from: {', '.join(choices)}"
        )
    return str(value)


def _component(name: str, value: object, granularity: str) -> ComponentQuant | None:
    if value is True:
        return ComponentQuant(granularity=granularity)
    if value is False:
        return None
    if not isinstance(value, dict):
        raise QuantizationError(
            f"--diffusion-quantization-config: {name} must be true, false or an object, got {type(value).__name__}"
        )
    allowed = _TEXT_FIELDS if name == "text_encoder" else _DIT_FIELDS
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise QuantizationError(
            f"--diffusion-quantization-config: unknown keys {unknown} in {name}; choose from: {', '.join(allowed)}"
        )
    exclude = value.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(p, str) and p for p in exclude):
        raise QuantizationError(f"--diffusion-quantization-config: {name}.exclude must be a list of name patterns")
    adaln = value.get("adaln", False)
    if not isinstance(adaln, bool):
        raise QuantizationError(f"--diffusion-quantization-config: {name}.adaln must be true or false")
    return ComponentQuant(
        granularity=_choice(f"{name}.granularity", value.get("granularity", granularity), GRANULARITIES),
        exclude=tuple(exclude),
        adaln=adaln,
    )


def parse_quantization(method: str | None, config_json: str | None) -> QuantizationConfig | None:
    """The QuantizationConfig of `--quantization` and `--diffusion-quantization-config`; None: full precision."""
    if method is None and not config_json:
        return None
    data: dict[str, object] = {}
    if config_json:
        try:
            data = json.loads(config_json)
        except json.JSONDecodeError as e:
            raise QuantizationError(f"--diffusion-quantization-config: invalid JSON ({e})") from None
        if not isinstance(data, dict):
            raise QuantizationError(
                f"--diffusion-quantization-config: expected a JSON object, got {type(data).__name__}"
            )
    known = ("method", "granularity", "kernel", *COMPONENTS)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise QuantizationError(
            f"--diffusion-quantization-config: unknown keys {unknown}; choose from: {', '.join(known)} "
            f"(components: {', '.join(COMPONENTS)})"
        )
    chosen = method if method is not None else data.get("method")
    if chosen is None:
        raise QuantizationError("--diffusion-quantization-config needs a method: add --quantization fp8")
    chosen = _choice("--quantization" if method is not None else "method", chosen, METHODS)
    if method is not None and data.get("method", method) != method:
        raise QuantizationError(
            f"--diffusion-quantization-config: method {data['method']!r} contradicts --quantization {method}"
        )
    granularity = _choice("granularity", data.get("granularity", "per_channel"), GRANULARITIES)
    components = []
    for name, component in COMPONENTS.items():
        quant = _component(name, data.get(name, True), granularity)
        if quant is not None:
            components.append((component, quant))
    return QuantizationConfig(
        method=chosen, kernel=_choice("kernel", data.get("kernel", "auto"), KERNELS), components=tuple(components)
    )


def fp8_gemm_refusal(device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why the FP8 GEMM (torch._scaled_mm) cannot run on this device, or None when it can: it needs FP8 tensor
    cores (CUDA compute capability 8.9: Ada, Hopper, Blackwell)."""
    if device_type != "cuda":
        return f"the {device_type} device has no FP8 GEMM (FP8 tensor cores need CUDA compute capability >= 8.9)"
    if capability is None or capability < (8, 9):
        shown = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return f"this GPU (compute capability {shown}) has no FP8 tensor cores (needs >= 8.9: Ada, Hopper, Blackwell)"
    return None
