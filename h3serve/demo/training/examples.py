"""Training examples for the demo DiTs, laid out by the pipeline's own first stage.

Every example goes through the functions a request goes through (`keyframes_encoded`, `reference_media`,
`presentation`, `reference_encoded`, the condition recipe `encode_visual_condition`), so the token layouts, RoPE
positions, row roles and text states the DiT learns on are exactly those of T2VA, FL2VA, Ref2VA and a continuation
window. Targets are the VAEs' normalised posterior means of the world's clips.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import numpy as np
import torch
from PIL import Image

from h3serve.demo.training.vaes import normalised_pixels
from h3serve.demo.world import drawn
from h3serve.demo.world import scenes as world
from h3serve.demo.world.grammar import prompt_for
from h3serve.model.conditioning import (
    AudioReference,
    encode_audio_condition,
    normalize_image_reference,
    prepare_keyframes,
)
from h3serve.model.encode_inputs import keyframes_encoded, presentation, reference_encoded, reference_media
from h3serve.model.layout import Layout, ReferenceBlock, patchify
from h3serve.model.pipeline_types import H3Components, LatentGuide, LatentTarget, StageClock
from h3serve.rules import geometry, limits
from h3serve.rules.long_video import plan_windows

CONTINUATION_OVERLAP_FRAMES = limits.DEFAULT_OVERLAP_FRAMES  # 22: the guide is 7 latent frames


@dataclass
class Example:
    """One laid-out training example: conditions clean (the trainer noise-augments them as the sampler does)."""

    kind: str  # t2va | fl2va | ref2va | plain | continuation
    prompt: str
    text_states: torch.Tensor  # [1, L, text_dim]
    layout: Layout
    conditions: torch.Tensor  # [Nc, C·4] clean visual condition rows, packed order
    audio_references: torch.Tensor  # [Nar, 32] clean reference (or guide) audio rows
    video: torch.Tensor  # [Nv, C·4] clean target rows
    audio: torch.Tensor  # [2·A, 32] clean target rows, channel-major
    anchored_rows: int = 0  # leading target rows a condition row gives (frame 0 under a first keyframe)
    click_rows: tuple[int, ...] = ()  # target audio rows holding a bounce's click (both channels)


@dataclass(frozen=True)
class SceneClip:
    """A rendered scene: frames, soundtrack and its attributes."""

    scene: world.Scene
    frames: np.ndarray  # [T, H, W, 3] uint8
    wave: np.ndarray  # [2, N] float32


def render(scene: world.Scene) -> SceneClip:
    return SceneClip(scene, world.render_video(scene), world.render_audio(scene))


@torch.no_grad()
def target_video_rows(vae, frames: np.ndarray) -> torch.Tensor:
    """Frames [T, H, W, 3] -> normalised posterior-mean latents as patchified rows [F·h/2·w/2, 96]."""
    return patchify(target_video_latents(vae, frames))


@torch.no_grad()
def target_video_latents(vae, frames: np.ndarray) -> torch.Tensor:
    """Frames [T, H, W, 3] (17n + 5) -> normalised posterior means [1, 24, F, h, w].

    The VAE's own `encode` runs its 17-frame clips one after another; they are independent (causal, no state carried),
    so here they run as one batch, 3x faster on the CPU, equal to within float rounding (~1e-5) for a canvas of at
    most one spatial tile (256 px), which the demo's is."""
    clip = vae.config.clip_length
    x = normalised_pixels(frames)  # [3, T, H, W]
    pad = (-x.shape[1]) % clip
    x = torch.cat([x, x[:, -1:].expand(-1, pad, -1, -1)], dim=1) if pad else x
    clips = x.unflatten(1, (-1, clip)).permute(1, 0, 2, 3, 4)  # [n, 3, 17, H, W]
    moments = vae.quant_conv(vae.encoder(clips))  # [n, 48, 5, h, w]
    moments = moments.permute(1, 0, 2, 3, 4).flatten(1, 2)[None, :, : -vae.config.token_drop]
    z = moments[:, : vae.config.latent_channels]
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z - mean) / std


def _stack(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.cat(rows) if rows else torch.zeros(0, width)


def click_rows(scene: world.Scene, start: int, latents: int) -> tuple[int, ...]:
    """The channel-major target audio rows [2·latents] of the clicks in the scene's audio latents [start, start +
    latents): a window of the soundtrack (the whole of it for start 0)."""
    clicks = [i - start for i in world.click_latents(scene, start + latents) if i >= start]
    return tuple(channel * latents + i for channel in range(limits.AUDIO_CHANNELS) for i in clicks)


class ExampleBuilder:
    """Lays out examples of every kind on loaded components (VAEs trained, latent statistics set)."""

    def __init__(self, components: H3Components, width: int, height: int, reference_short_edge: int):
        self.components = components
        self.width, self.height = width, height
        self.reference_short_edge = reference_short_edge  # the checkpoint's reference_image_short_edge
        self.clock = StageClock(torch.device("cpu"))
        self.patch_dim = components.vae.config.latent_channels * 4
        self.audio_dim = components.audio_vae.config.latent_channels
        self._last_targets: tuple[SceneClip, torch.Tensor, torch.Tensor] | None = None

    def _target(self, frames: int) -> LatentTarget:
        lh, lw = self.height // limits.VAE_SPATIAL_COMPRESSION, self.width // limits.VAE_SPATIAL_COMPRESSION
        return LatentTarget(geometry.latent_frames(frames), lh, lw, geometry.audio_latents(frames))

    def _targets(self, clip: SceneClip) -> tuple[torch.Tensor, torch.Tensor]:
        """The clip's target rows, encoded once for all the examples laid out from it."""
        if self._last_targets is None or self._last_targets[0] is not clip:
            video = target_video_rows(self.components.vae, clip.frames)
            audio = encode_audio_condition(self.components.audio_vae, torch.from_numpy(clip.wave))
            self._last_targets = (clip, video, audio)
        return self._last_targets[1], self._last_targets[2]

    def keyframes(self, clip: SceneClip, anchors: tuple[str, ...]) -> Example:
        """T2VA (no anchors) or FL2VA with a first and/or last keyframe taken from the clip itself."""
        images = [Image.fromarray(clip.frames[0 if a == "first" else -1]) for a in anchors]
        return self._keyframes(clip, anchors, images)

    def drawn_keyframes(self, clip: SceneClip, anchors: tuple[str, ...], rng: np.random.Generator) -> Example:
        """FL2VA with keyframes of the clip's first and/or last frame as a person draws them (`drawn`), put on the
        canvas by the server's own fit (`prepare_keyframes`)."""
        last = clip.frames.shape[0] - 1
        images = [drawn.drawn_keyframe(rng, clip.scene, 0 if a == "first" else last, stretched=i == 0)
                  for i, a in enumerate(anchors)]
        return self._keyframes(clip, anchors, prepare_keyframes([Image.fromarray(i) for i in images], self.width,
                                                                self.height))

    def _keyframes(self, clip: SceneClip, anchors: tuple[str, ...], images: list[Image.Image]) -> Example:
        prompt = prompt_for(clip.scene.attrs)
        target = self._target(clip.frames.shape[0])
        plan = _Plan(prompt, *astuple(target))
        enc = keyframes_encoded(self.components, torch.device("cpu"), plan, images, anchors, self.clock)
        video, audio = self._targets(clip)
        conditions = _stack([patchify(z) for z in enc.visual], self.patch_dim)
        kind = "fl2va" if anchors else "t2va"
        anchored = video.shape[0] // target.latent_frames if "first" in anchors else 0
        return Example(kind, prompt, enc.text_states, enc.layout, conditions, torch.zeros(0, self.audio_dim),
                       video, audio, anchored, click_rows(clip.scene, 0, target.audio_latents))

    def references(self, clip: SceneClip, with_sound: bool) -> Example:
        """Ref2VA: a reference image of the object (its colour), and with `with_sound` a reference audio clip of the
        tone (its pitch); the prompt names only the shape and the motion (and the sound without a reference)."""
        attrs = clip.scene.attrs
        sound = world.reference_audio(attrs.sound) if with_sound else None
        return self._references(clip, world.reference_image(attrs.color, attrs.shape), sound)

    def drawn_references(self, clip: SceneClip, with_sound: bool, rng: np.random.Generator) -> Example:
        """`references` with a reference image (and sound) as a person makes them (`drawn`); the sound cut to the
        clip's length, as the server cuts a reference clip to the request's duration."""
        attrs = clip.scene.attrs
        image = drawn.drawn_reference_image(rng, attrs.color, attrs.shape)
        sound = None
        if with_sound:
            keep = int(clip.frames.shape[0] / limits.FPS * limits.AUDIO_SAMPLE_RATE)
            sound = drawn.drawn_reference_audio(rng, attrs.sound)[:, :keep]
        return self._references(clip, image, sound)

    def _references(self, clip: SceneClip, image: np.ndarray, sound: np.ndarray | None) -> Example:
        attrs = clip.scene.attrs
        with_sound = sound is not None
        refs: list = [normalize_image_reference(Image.fromarray(image), self.reference_short_edge)]
        if sound is not None:
            refs.append(AudioReference(torch.from_numpy(np.ascontiguousarray(sound))))
        media = reference_media(self.components, torch.device("cpu"), refs, self.clock)
        prompt = prompt_for(attrs, reference_image=True, reference_sound=with_sound)
        text = presentation(self.components, media, prompt)
        target = self._target(clip.frames.shape[0])
        enc = reference_encoded(self.components, media, text, target, self.clock)
        video, audio = self._targets(clip)
        conditions = _stack([patchify(z) for z in enc.visual], self.patch_dim)
        audio_references = _stack(enc.audio_rows, self.audio_dim)
        return Example("ref2va", prompt, enc.text_states, enc.layout, conditions, audio_references, video, audio,
                       click_rows=click_rows(clip.scene, 0, target.audio_latents))

    def continuation(self, clip: SceneClip, window_frames: int) -> list[Example]:
        """Every window of a continuation over the clip (no references), as the pipeline lays them out: the first
        plain, each next one guided by the previous window's last overlap latents, on the global timeline."""
        prompt = prompt_for(clip.scene.attrs)
        media = reference_media(self.components, torch.device("cpu"), [], self.clock)
        text = presentation(self.components, media, prompt)
        video_latents = target_video_latents(self.components.vae, clip.frames)
        audio_rows = encode_audio_condition(self.components.audio_vae, torch.from_numpy(clip.wave))
        audio_latents = audio_rows.reshape(limits.AUDIO_CHANNELS, -1, self.audio_dim).permute(0, 2, 1)
        windows = plan_windows(clip.frames.shape[0], window_frames, CONTINUATION_OVERLAP_FRAMES)
        examples = []
        for window in windows:
            # Windows start on clip boundaries (W - O is a multiple of 17), where the clip's encode and the window's
            # own encode agree: 17 frames -> 5 latent frames.
            start = window.start // limits.VAE_FRAMES_PER_CHUNK * limits.VAE_LATENTS_PER_CHUNK
            video = video_latents[:, :, start : start + window.latent_frames]
            audio = audio_latents[:, :, window.audio_start : window.audio_end]
            guide = None
            if window.index:
                guide_video = video[:, :, : window.overlap_latent_frames]
                guide_audio = audio[:, :, : window.overlap_audio_latents]
                block = ReferenceBlock("latent_guide", *guide_video.shape[2:], guide_audio.shape[2])
                guide = (block, LatentGuide(guide_video, guide_audio))
            target = LatentTarget(window.latent_frames, video.shape[3], video.shape[4], window.audio_latents)
            enc = reference_encoded(self.components, media, text, target, self.clock, guide, float(len(text.ids)),
                                    window.temporal_offset)
            conditions = _stack([patchify(z) for z in enc.visual], self.patch_dim)
            kind = "continuation" if window.index else "plain"
            target_audio = audio.permute(0, 2, 1).reshape(-1, self.audio_dim)
            examples.append(Example(kind, prompt, enc.text_states, enc.layout, conditions,
                                    _stack(enc.audio_rows, self.audio_dim), patchify(video), target_audio,
                                    click_rows=click_rows(clip.scene, window.audio_start, window.audio_latents)))
        return examples


@dataclass(frozen=True)
class _Plan:
    """The few plan fields `keyframes_encoded` reads: the prompt and the target's geometry."""

    prompt: str
    latent_frames: int
    latent_height: int
    latent_width: int
    audio_latents: int
