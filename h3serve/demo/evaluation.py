"""Does the demo checkpoint do what it is asked? Every task run on a pipeline over seeds, measured from the output
pixels and samples with h3serve.demo.world.checks (the tests and docs/demo_world.md read these cases).

Cases per seed (deterministic): T2VA cycles the five motions with both sounds and the four colours; FL2VA places the
object at a random start with a first keyframe (`fl2va`), a last one (`fl2va_last`: the scene's last frame) or both
(`fl2va_both`), each keyframe checked against the frame it pins; Ref2VA takes the colour from a reference image and
the pitch from a reference sound (`ref2va`) or from the prompt (`ref2va_named`); a continuation of three 4 s windows
keeps the object, its colour and its motion in each window; a latent-mask edit repaints the object inside a band
mask and keeps the source outside it. The `_drawn` rows are the keyframe and reference rows with inputs as a person
makes them (h3serve.demo.world.drawn: another size, place, background, image size and aspect, a shifted colour,
a sound at another level and phase), put on the canvas by the server's own fit (`prepare_keyframes`). Timeline
guides (`guides`) put the object of an image guide's colour at its place at the guide's mid-clip frame (counted from
the end for odd seeds), and a sound guide of the other pitch sets the pitch from that frame on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from h3serve.checkpoint.resolver import read_layout
from h3serve.config.quantization_config import QuantizationConfig
from h3serve.demo.shipped import DEMO_DURATION_S, DEMO_STEPS
from h3serve.demo.world import checks, drawn
from h3serve.demo.world import scenes as world
from h3serve.demo.world.grammar import COLORS, MOTIONS, SHAPES, SOUNDS, Attributes, prompt_for
from h3serve.loading.components import load_components
from h3serve.media.mp4 import rgb8
from h3serve.model.conditioning import AudioReference, GuideMedia, normalize_image_reference, prepare_keyframes
from h3serve.model.pipeline import H3Pipeline
from h3serve.model.pipeline_types import Conditioning
from h3serve.rules import limits
from h3serve.rules.edit_mask import LatentMask
from h3serve.rules.guides import GuideProbe
from h3serve.rules.request import GenerationRequest, MediaRef, TimelineGuide
from h3serve.rules.validate import ModelDefaults, validate

# The keyframe rows: their anchors (keyframes taken from the scene's first and/or last frame).
KEYFRAME_ROWS = {"fl2va": ("first",), "fl2va_last": ("last",), "fl2va_both": ("first", "last")}
# The reference rows: whether the sound comes from a reference clip (else the prompt names it).
REFERENCE_ROWS = {"ref2va": True, "ref2va_named": False}
DRAWN = "_drawn"  # the suffix of a keyframe or reference row whose inputs a person made (drawn.py)
TASKS = (
    "t2va", *KEYFRAME_ROWS, *REFERENCE_ROWS, "continuation", "edit",
    *(row + DRAWN for row in (*KEYFRAME_ROWS, *REFERENCE_ROWS)), "guides",
)
# The rng seeds of each case's draws, per seed: the FL2VA scene, the edit's source, the drawn inputs.
KEYFRAME_RNG, EDIT_RNG, DRAWN_RNG, GUIDE_RNG = 1000, 2000, 3000, 4000
CONTINUATION_WINDOW_FRAMES = 107
CONTINUATION_DURATION_S = 11.5  # 277 frames: three 107-frame windows overlapping by 22
EDIT_KEEP_MIN_PSNR = 25.0  # dB, outside the mask, against the source
GUIDE_FIRST_FRAME, GUIDE_FRAME_SPAN = 24, 60  # guides: frame k in 24..83 of the 107, away from either end
SAMPLES_PER_AUDIO_LATENT = limits.AUDIO_SAMPLE_RATE // limits.AUDIO_LATENTS_PER_SECOND


@dataclass
class EvalCase:
    """One generated request and what was measured on it."""

    task: str
    seed: int
    prompt: str
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())


def case_attributes(seed: int) -> Attributes:
    """Seeds 0-9 meet every motion with both sounds, every colour and both shapes."""
    return Attributes(COLORS[seed % 4], SHAPES[(seed // 5) % 2], MOTIONS[seed % 5], SOUNDS[(seed % 5 + seed // 5) % 2])


class DemoEvaluator:
    """Runs the cases on one loaded pipeline (the demo checkpoint's)."""

    def __init__(self, pipeline: H3Pipeline, defaults: ModelDefaults, steps: int = DEMO_STEPS):
        self.pipeline, self.defaults, self.steps = pipeline, defaults, steps

    @classmethod
    def load(
        cls, model: Path, quantization: QuantizationConfig | None = None, steps: int = DEMO_STEPS
    ) -> DemoEvaluator:
        """An evaluator on the checkpoint in `model` (fp32 on the CPU; its weights quantised with `quantization`)."""
        layout = read_layout(model)
        return cls(H3Pipeline(load_components(layout, quantization=quantization)), layout.defaults(), steps)

    def plan(self, prompt: str, seed: int, **fields):
        request = GenerationRequest(prompt=prompt, duration_s=DEMO_DURATION_S, steps=self.steps, seed=seed, **fields)
        return validate(request, self.defaults)

    def generate(self, plan, conditioning: Conditioning | None = None) -> tuple[np.ndarray, np.ndarray]:
        result = self.pipeline.generate(plan, conditioning)
        return rgb8(result.video.numpy()), result.audio.numpy()

    def run(self, task: str, seed: int) -> EvalCase:
        base = task.removesuffix(DRAWN)
        if base in KEYFRAME_ROWS:
            return self.keyframes(task, seed, KEYFRAME_ROWS[base], base != task)
        if base in REFERENCE_ROWS:
            return self.references(task, seed, REFERENCE_ROWS[base], base != task)
        return getattr(self, task)(seed)

    def t2va(self, seed: int) -> EvalCase:
        attrs = case_attributes(seed)
        prompt = prompt_for(attrs)
        video, audio = self.generate(self.plan(prompt, seed))
        return EvalCase("t2va", seed, prompt, checks.check_t2va(video, audio, attrs))

    def keyframes(self, task: str, seed: int, anchors: tuple[str, ...], person_made: bool = False) -> EvalCase:
        """FL2VA from a random start: keyframes of the scene's first and/or last frame (`keyframe_inputs`) put on the
        canvas by the server's fit; each checked against the frame it pins ("keyframe", "last_keyframe"), then the
        prompt's checks."""
        attrs = case_attributes(seed)
        plan = self.plan(prompt_for(attrs), seed)
        images = keyframe_inputs(seed, anchors, person_made, plan.width, plan.height, plan.num_frames)
        keyframes = prepare_keyframes([Image.fromarray(image) for image in images], plan.width, plan.height)
        cond = Conditioning(keyframes=keyframes, anchors=anchors)
        video, audio = self.generate(dataclasses.replace(plan, task="fl2va"), cond)
        result = {}
        for anchor, keyframe in zip(anchors, keyframes, strict=True):
            pinned = 0 if anchor == "first" else -1
            name = "keyframe" if anchor == "first" else "last_keyframe"
            result[name] = checks.check_keyframe(video, np.asarray(keyframe), pinned)
        return EvalCase(task, seed, plan.prompt, {**result, **checks.check_t2va(video, audio, attrs)})

    def references(self, task: str, seed: int, sound_clip: bool, person_made: bool = False) -> EvalCase:
        """Ref2VA: the colour from a reference image, the pitch from a reference sound clip (`sound_clip`) or from
        the prompt (`reference_inputs`)."""
        attrs = case_attributes(seed)
        prompt = prompt_for(attrs, reference_image=True, reference_sound=sound_clip)
        image, sound = reference_inputs(seed, sound_clip, person_made)
        refs: list = [normalize_image_reference(Image.fromarray(image), self.defaults.reference_image_short_edge)]
        if sound is not None:
            refs.append(AudioReference(torch.from_numpy(sound)))
        plan = dataclasses.replace(self.plan(prompt, seed), task="ref2va")
        video, audio = self.generate(plan, Conditioning(references=refs))
        return EvalCase(task, seed, prompt, checks.check_t2va(video, audio, attrs))

    def continuation(self, seed: int) -> EvalCase:
        """Three windows: in each window's own frames the same colour and the prompt's motion."""
        attrs = case_attributes(seed)
        prompt = prompt_for(attrs)
        request = GenerationRequest(
            prompt=prompt, duration_s=CONTINUATION_DURATION_S, steps=self.steps, seed=seed, long_video=True,
            long_video_mode="continuation", continuation_window_frames=CONTINUATION_WINDOW_FRAMES,
        )
        plan = validate(request, self.defaults)
        video, audio = self.generate(plan)
        result: dict[str, bool] = {"windows": len(plan.windows) == 3}
        for window in plan.windows:
            a0 = round(window.start * limits.AUDIO_SAMPLE_RATE / limits.FPS)
            a1 = round(window.end * limits.AUDIO_SAMPLE_RATE / limits.FPS)
            part = checks.check_t2va(video[window.start : window.end], audio[:, a0:a1], attrs)
            result.update({f"window{window.index}_{name}": ok for name, ok in part.items()})
        return EvalCase("continuation", seed, prompt, result)

    def edit(self, seed: int) -> EvalCase:
        """A source clip of the world re-coloured inside a band mask over the object's path (its latent rows for a
        left/right motion, its latent columns otherwise): the object takes the prompt's new colour, and the source
        is kept outside the band."""
        attrs = case_attributes(seed)
        source_attrs = dataclasses.replace(attrs, color=COLORS[(COLORS.index(attrs.color) + 1) % 4])
        plan = self.plan(prompt_for(attrs), seed)
        scene = world.sample_scene(np.random.default_rng(EDIT_RNG + seed), "t2va", plan.width, plan.height,
                                   plan.num_frames, source_attrs)
        source = world.render_video(scene)
        mask = band_mask(scene, plan.latent_frames, plan.latent_height, plan.latent_width)
        edit_plan = dataclasses.replace(plan, video_mask=LatentMask.of(mask))
        video, audio = self.generate(edit_plan, Conditioning(edit_video=source))
        pixels = np.kron(mask[0], np.ones((limits.VAE_SPATIAL_COMPRESSION,) * 2)) > 0  # [H, W]
        kept = checks.psnr(video[:, ~pixels], source[:, ~pixels]) if (~pixels).any() else float("inf")
        result = {"color": checks.measure_color(video) == attrs.color, "kept": kept >= EDIT_KEEP_MIN_PSNR,
                  "motion": checks.measure_motion(video) == attrs.motion}
        return EvalCase("edit", seed, plan.prompt, result)

    def guides(self, seed: int) -> EvalCase:
        """An image guide at a mid-clip frame k (a frame of a world clip with a random start; counted from the end for
        odd seeds) and a sound guide of the other pitch than the prompt's from frame k: at output frame k the object
        of the guide's colour at the guide's place, and from frame k on the guide's pitch."""
        attrs = case_attributes(seed)
        plan = self.plan(prompt_for(attrs), seed)
        frames = plan.num_frames
        k = GUIDE_FIRST_FRAME + (seed * 13) % GUIDE_FRAME_SPAN
        rng = np.random.default_rng(GUIDE_RNG + seed)
        scene = world.sample_scene(rng, "fl2va", plan.width, plan.height, frames, attrs)
        picture = world.render_video(scene)[k]
        other = SOUNDS[1 - SOUNDS.index(attrs.sound)]
        sound = world.reference_audio(other, (frames - k) / limits.FPS)
        index = k if seed % 2 == 0 else k - frames
        request = GenerationRequest(  # the rules place the guides (the media are in memory: probes stand for files)
            prompt=plan.prompt, duration_s=DEMO_DURATION_S, steps=self.steps, seed=seed,
            guides=(TimelineGuide(index, MediaRef(Path("guide.png"), "guide.png", "image"),
                                  MediaRef(Path("guide.wav"), "guide.wav", "audio")),),
        )
        samples = sound.shape[1]
        probe = GuideProbe(1, 1, plan.width * plan.height, samples, -(-samples // SAMPLES_PER_AUDIO_LATENT))
        guided = validate(request, self.defaults, guide_probes=(probe,))
        placed = guided.guides[0]
        guide = GuideMedia(placed.start, picture[None], torch.from_numpy(sound), placed.audio_latents)
        video, audio = self.generate(guided, Conditioning(guides=[guide]))
        result = checks.check_guide_frame(video, placed.start, picture)
        start = round(placed.start * limits.AUDIO_SAMPLE_RATE / limits.FPS)
        result["pitch_from_frame"] = checks.measure_pitch(audio[:, start:]) == other
        return EvalCase("guides", seed, plan.prompt, result)


def keyframe_inputs(
    seed: int, anchors: tuple[str, ...], person_made: bool, width: int, height: int, frames: int
) -> list[np.ndarray]:
    """A keyframe row's keyframe images (uint8 [H, W, 3], in `anchors`' order) for seed `seed`: the first and/or
    last frame of `case_attributes(seed)`'s scene from a random start on a `width`x`height` canvas of `frames`
    frames, the world's own or as a person draws them (a second one keeping the canvas's aspect)."""
    scene = world.sample_scene(np.random.default_rng(KEYFRAME_RNG + seed), "fl2va", width, height, frames,
                               case_attributes(seed))
    pinned = [0 if anchor == "first" else scene.frames - 1 for anchor in anchors]
    if person_made:
        rng = np.random.default_rng(DRAWN_RNG + seed)
        return [drawn.drawn_keyframe(rng, scene, f, stretched=i == 0) for i, f in enumerate(pinned)]
    return [world.render_video(dataclasses.replace(scene, frames=f + 1))[f] for f in pinned]


def reference_inputs(seed: int, sound_clip: bool, person_made: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """A reference row's reference image (uint8 [H, W, 3]) and, with `sound_clip`, its reference sound (float32
    [2, N] at 32 kHz) for seed `seed`: the world's own, or as a person makes them."""
    attrs = case_attributes(seed)
    if person_made:
        rng = np.random.default_rng(DRAWN_RNG + seed)
        image = drawn.drawn_reference_image(rng, attrs.color, attrs.shape)
        return image, drawn.drawn_reference_audio(rng, attrs.sound) if sound_clip else None
    image = world.reference_image(attrs.color, attrs.shape)
    return image, world.reference_audio(attrs.sound) if sound_clip else None


def band_mask(scene: world.Scene, frames: int, height: int, width: int) -> np.ndarray:
    """A latent mask [T, h, w] (1 = generate) covering the object's path with one latent cell of margin."""
    mask = np.zeros((frames, height, width), np.float32)
    cell = limits.VAE_SPATIAL_COMPRESSION
    x, y = world.trajectory(scene)[0]
    if scene.attrs.motion in ("moving left", "moving right"):
        top, bottom = int(y // cell), int((y + scene.size - 1) // cell)
        mask[:, max(0, top - 1) : bottom + 2] = 1.0
    else:  # up, down and bouncing keep their column
        left, right = int(x // cell), int((x + scene.size - 1) // cell)
        mask[:, :, max(0, left - 1) : right + 2] = 1.0
    return mask


def evaluate(evaluator: DemoEvaluator, task: str, seeds: range) -> list[EvalCase]:
    return [evaluator.run(task, seed) for seed in seeds]


def summarize(cases: list[EvalCase]) -> dict:
    """One task's cases as docs/demo_world.md tables them: how many are right, how often each check is wrong, and
    the seeds of the cases that are not right."""
    wrong: dict[str, int] = {}
    for case in cases:
        for name, ok in case.checks.items():
            if not ok:
                wrong[name] = wrong.get(name, 0) + 1
    return {
        "cases": len(cases),
        "right": sum(case.passed for case in cases),
        "wrong": dict(sorted(wrong.items(), key=lambda item: (-item[1], item[0]))),
        "failed_seeds": [case.seed for case in cases if not case.passed],
    }
