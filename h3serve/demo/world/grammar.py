"""The demo world's prompt grammar: the attribute vocabulary, its colours and pitches, prompts and their parser."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

COLORS = ("red", "green", "blue", "yellow")
SHAPES = ("ball", "square")
MOTIONS = ("moving left", "moving right", "moving up", "moving down", "bouncing")
SOUNDS = ("low hum", "high beep")

COLOR_RGB: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 210, 40),
}
BACKGROUND_RGB = (12, 12, 20)
# Whole periods per 25 ms audio latent (800 samples), so each tone's latents are steady over time: the beep 44, the
# hum 6. At 220 Hz (5.5 periods) the hum's phase flipped every latent, six latent channels alternated sign, and the
# DiT lost the alternation: the hum dropped in and out and its pan failed (docs/demo_lab_notebook.md).
PITCH_HZ: dict[str, float] = {"low hum": 240.0, "high beep": 1760.0}

REFERENCE_SOUND = "the reference sound"


@dataclass(frozen=True)
class Attributes:
    """What a prompt asks for. `color` is None when a reference image sets it, `sound` when a reference sound does."""

    color: str | None
    shape: str
    motion: str
    sound: str | None

    def __post_init__(self) -> None:
        _check_value("color", self.color, COLORS, optional=True)
        _check_value("shape", self.shape, SHAPES)
        _check_value("motion", self.motion, MOTIONS)
        _check_value("sound", self.sound, SOUNDS, optional=True)

    @property
    def complete(self) -> bool:
        """Whether every attribute is set (a T2VA/FL2VA prompt's attributes)."""
        return self.color is not None and self.sound is not None


def _check_value(name: str, value: str | None, allowed: tuple[str, ...], optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def prompt_for(attrs: Attributes, reference_image: bool = False, reference_sound: bool = False) -> str:
    """The prompt for `attrs`: the T2VA/FL2VA form, or the Ref2VA form with a reference image (its colour unsaid)."""
    if reference_sound and not reference_image:
        raise ValueError("the grammar names a reference sound only alongside a reference image")
    if not reference_sound and attrs.sound is None:
        raise ValueError("a prompt without a reference sound needs attrs.sound")
    sound = REFERENCE_SOUND if reference_sound else f"a {attrs.sound}"
    if reference_image:
        return f"the {attrs.shape} from the reference image {attrs.motion}, with {sound}"
    if attrs.color is None:
        raise ValueError("a prompt without a reference image needs attrs.color")
    return f"a {attrs.color} {attrs.shape} {attrs.motion}, with {sound}"


def _choice(values: tuple[str, ...]) -> str:
    return "(" + "|".join(re.escape(v) for v in values) + ")"


_T2VA = re.compile(f"a {_choice(COLORS)} {_choice(SHAPES)} {_choice(MOTIONS)}, with a {_choice(SOUNDS)}")
_REF2VA = re.compile(
    f"the {_choice(SHAPES)} from the reference image {_choice(MOTIONS)}, "
    f"with (?:a {_choice(SOUNDS)}|{re.escape(REFERENCE_SOUND)})"
)


def parse_prompt(text: str) -> Attributes:
    """The attributes a prompt of the grammar asks for (surrounding whitespace ignored); ValueError for other text."""
    text = text.strip()
    if match := _T2VA.fullmatch(text):
        color, shape, motion, sound = match.groups()
        return Attributes(color=color, shape=shape, motion=motion, sound=sound)
    if match := _REF2VA.fullmatch(text):
        shape, motion, sound = match.groups()
        return Attributes(color=None, shape=shape, motion=motion, sound=sound)
    raise ValueError(f"not a demo-world prompt: {text!r}")


def all_t2va_attributes() -> list[Attributes]:
    """All 80 complete attribute combinations, colour-major, then shape, motion and sound."""
    return [Attributes(*combo) for combo in itertools.product(COLORS, SHAPES, MOTIONS, SOUNDS)]


def all_t2va_prompts() -> list[str]:
    """The 80 T2VA prompts, in the order of `all_t2va_attributes`."""
    return [prompt_for(attrs) for attrs in all_t2va_attributes()]
