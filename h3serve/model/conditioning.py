"""Visual and audio conditioning for FL2VA keyframes and Ref2VA references (docs/model.md §8).

Pure array work (PIL, numpy, torch): decoded media in, normalised references, presentation tokens and
condition latents out. Decoding files and resampling audio happen before, in `h3serve.media`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from PIL import Image

from h3serve.rules import geometry, limits

VIDEO_SAMPLE_FPS = 2.0  # the conditioner reads reference videos at 2 fps
TEMPORAL_PATCH = 2  # ... and merges sampled frames in pairs


@dataclass
class ImageReference:
    image: Image.Image  # RGB, resized to the reference short edge


@dataclass
class VideoReference:
    frames: np.ndarray  # (T, H, W, 3) uint8 at 24 fps, on its own canvas
    audio: torch.Tensor | None = None  # (2, N) float32 at 32 kHz: its soundtrack


@dataclass
class AudioReference:
    audio: torch.Tensor  # (2, N) float32 at 32 kHz


Reference = ImageReference | VideoReference | AudioReference


def reference_kind(ref: Reference) -> str:
    return {ImageReference: "image", VideoReference: "video", AudioReference: "audio"}[type(ref)]


def reference_audio(ref: Reference) -> torch.Tensor | None:
    return ref.audio if isinstance(ref, VideoReference | AudioReference) else None


# ------------------------------------------------------------------------------------------------------------
# Geometry
# ------------------------------------------------------------------------------------------------------------


def prepare_keyframes(images: list[Image.Image], width: int, height: int) -> list[Image.Image]:
    """Put keyframes on the canvas: the first is stretched (LANCZOS), a second one is cover-cropped."""
    out = []
    for index, img in enumerate(images):
        if img.size == (width, height):
            out.append(img)
        elif index == 0:
            out.append(img.resize((width, height), Image.Resampling.LANCZOS))
        else:
            scale = max(width / img.size[0], height / img.size[1])
            size = (max(width, round(img.size[0] * scale)), max(height, round(img.size[1] * scale)))
            left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
            out.append(img.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
    return out


def normalize_image_reference(img: Image.Image, short_edge: int) -> ImageReference:
    """Scale so the short edge is `short_edge` (up or down, no area cap), both axes rounded to 32."""
    w, h = img.size
    m = limits.SPATIAL_MULTIPLE
    scale = short_edge / min(w, h)
    size = (max(m, round(w * scale / m) * m), max(m, round(h * scale / m) * m))
    return ImageReference(img if img.size == size else img.resize(size, Image.Resampling.LANCZOS))


def resample_frames_to_24fps(frames: np.ndarray, fps: float) -> np.ndarray:
    """Hold frames: frame i starts at slot floor(i·24/fps + 0.5) and repeats until the next one's slot."""
    if fps == limits.FPS:
        return frames
    scale = limits.FPS / fps
    slots = np.floor(np.arange(frames.shape[0]) * scale + 0.5).astype(np.int64)
    counts = np.diff(slots, append=math.floor(frames.shape[0] * scale + 0.5))
    return np.repeat(frames, counts, axis=0)


def normalize_video_reference(
    frames: np.ndarray, fps: float, num_frames: int, short_edge: int, max_pixels: int, audio: torch.Tensor | None
) -> VideoReference:
    """24 fps by holding frames, truncated to the target length, resized to its own aspect's canvas."""
    frames = resample_frames_to_24fps(frames, fps)[:num_frames]
    height, width = geometry.resolve_canvas_size(frames.shape[2], frames.shape[1], short_edge, max_pixels)
    if frames.shape[1:3] != (height, width):
        frames = np.stack(
            [np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.LANCZOS)) for f in frames]
        )
    return VideoReference(frames=frames, audio=audio)


class StreamingVideoNormalizer:
    """`normalize_video_reference`'s frames computed while the clip decodes (a `FrameReducer` of
    h3serve.media.video_intake): each source frame is resized as it arrives and kept once with its hold count, so a
    4K clip never sits in memory at 4K. The result equals `resample_frames_to_24fps(frames, fps)[:num_frames]`
    resized frame by frame."""

    def __init__(self, fps: float, width: int, height: int, num_frames: int, short_edge: int, max_pixels: int):
        self.scale = limits.FPS / fps
        self.num_frames = num_frames
        self.height, self.width = geometry.resolve_canvas_size(width, height, short_edge, max_pixels)
        self.source_size = (height, width)
        self.kept: list[tuple[np.ndarray, int]] = []  # (frame at the canvas size, output slots it holds)

    def _slot(self, index: int) -> int:
        return index if self.scale == 1 else math.floor(index * self.scale + 0.5)

    def add(self, index: int, rgb: np.ndarray) -> None:
        start, end = self._slot(index), min(self._slot(index + 1), self.num_frames)
        if end <= start:
            return  # held for no slot (a faster source), or past the target length
        if rgb.shape[:2] != (self.height, self.width):
            rgb = np.asarray(Image.fromarray(rgb).resize((self.width, self.height), Image.Resampling.LANCZOS))
        self.kept.append((rgb, end - start))

    def result(self) -> np.ndarray:
        out = np.empty((sum(n for _, n in self.kept), self.height, self.width, 3), dtype=np.uint8)
        i = 0
        for frame, n in self.kept:
            out[i : i + n] = frame
            i += n
        self.kept = []
        return out


def sample_condition_frames(frames: np.ndarray, fps: float = limits.FPS) -> tuple[list[np.ndarray], list[float]]:
    """Frames the conditioner sees (2 fps, deduplicated) and one timestamp per merged pair (mean of the pair)."""
    stride = fps / VIDEO_SAMPLE_FPS
    indices: list[int] = []
    cursor = 0.0
    while round(cursor) < frames.shape[0]:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    if len(indices) < TEMPORAL_PATCH:
        minimum = round((TEMPORAL_PATCH - 1) * stride) + 1
        raise ValueError(f"a reference video needs at least {minimum} frames at {fps:g} fps, got {frames.shape[0]}")
    stamps = [i / VIDEO_SAMPLE_FPS for i in range(len(indices))]
    stamps += [stamps[-1]] * (-len(stamps) % TEMPORAL_PATCH)
    pairs = [(stamps[i] + stamps[i + TEMPORAL_PATCH - 1]) / 2 for i in range(0, len(stamps), TEMPORAL_PATCH)]
    return [frames[i] for i in indices], pairs


# ------------------------------------------------------------------------------------------------------------
# Presentation: what the text encoder reads
# ------------------------------------------------------------------------------------------------------------


class Presentation:
    """Token ids and AdaLN tags built piece by piece: labels and prompt are text (1), vision blocks video (0)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.tags: list[int] = []

    def text(self, value: str) -> None:
        ids = self.tokenizer(value, add_special_tokens=False)["input_ids"]
        self.ids += ids
        self.tags += [limits.TEXT_TAG] * len(ids)

    def vision(self, pad_token: str, count: int) -> None:
        tok = self.tokenizer.convert_tokens_to_ids
        ids = [tok("<|vision_start|>")] + [tok(pad_token)] * count + [tok("<|vision_end|>")]
        self.ids += ids
        self.tags += [limits.VIDEO_TAG] * len(ids)


# ------------------------------------------------------------------------------------------------------------
# Latents
# ------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def encode_visual_condition(vae, pixels: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """uint8 pixels [1, 3, T, H, W] (on any device) -> normalised condition latents [1, 24, F, h, w] fp32 (CPU).

    The release's recipe: ImageNet-normalise, sample the posterior under a fresh seed-42 generator, round
    through float16, then normalise per channel.

    The VAE encodes a video as independent `clip_length`-frame clips (the last one padded by repeating its last
    frame, `token_drop` trailing latents dropped), so this runs it one clip at a time: only one clip is normalised
    in fp32 and on `device` (default: the pixels' device) at once, where encoding the whole video would hold three
    or four fp32 copies of it (4.5 GB each for 15 s at 1344x768). The moments are the same and the posterior noise is
    drawn once over the whole latent shape, so the latents are bit-identical to `vae.encode` on the whole video.
    """
    posterior = DiagonalGaussianDistribution(_clip_moments(vae, pixels, device, _imagenet_normalised))
    z = posterior.sample(generator=torch.Generator().manual_seed(limits.KEYFRAME_ENCODE_SEED))
    return _normalised_latents(vae, z.to(torch.float16).float().cpu())


@torch.no_grad()
def encode_control_video(vae, pixels: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """fp32 pixels [1, 3, T, H, W] in [0, 1] (a ControlNet input, resized) -> normalised posterior-mode latents
    [1, 24, F, h, w] fp32 (CPU): ImageNet-normalised, encoded clip by clip as `encode_visual_condition`."""
    moments = _clip_moments(vae, pixels, device, _imagenet_normalised_unit)
    return _normalised_latents(vae, DiagonalGaussianDistribution(moments).mode().float().cpu())


def _clip_moments(vae, pixels: torch.Tensor, device: torch.device | None, normalise) -> torch.Tensor:
    """The VAE encoder's posterior moments of `pixels`, one `clip_length` clip at a time (see
    `encode_visual_condition`)."""
    device = pixels.device if device is None else device
    dtype = next(vae.encoder.parameters()).dtype
    clip, frames = vae.config.clip_length, pixels.shape[2]
    if frames == 1:  # no temporal extent: the spatial encoder alone, as `vae.encode` does
        return vae._encode_clip(normalise(pixels.to(device)).to(dtype))
    parts = []
    for start in range(0, frames, clip):
        part = pixels[:, :, start : start + clip].to(device)
        if part.shape[2] < clip:
            part = torch.cat([part, part[:, :, -1:].repeat(1, 1, clip - part.shape[2], 1, 1)], dim=2)
        parts.append(vae._encode_clip(normalise(part).to(dtype)))
    moments = torch.cat(parts, dim=2)
    if vae.config.token_drop > 0:
        moments = moments[:, :, : -vae.config.token_drop]
    return moments


def _normalised_latents(vae, z: torch.Tensor) -> torch.Tensor:
    z_mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    z_std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z - z_mean) / z_std


def _imagenet_normalised_unit(pixels: torch.Tensor) -> torch.Tensor:
    """fp32 [1, 3, T, H, W] in [0, 1] -> ImageNet-normalised."""
    mean = torch.tensor(limits.PIXEL_MEAN, device=pixels.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(limits.PIXEL_STD, device=pixels.device).view(1, -1, 1, 1, 1)
    return (pixels.to(torch.float32) - mean) / std


def _imagenet_normalised(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [1, 3, T, H, W] -> fp32 ImageNet-normalised, on the pixels' device."""
    mean = torch.tensor(limits.PIXEL_MEAN, device=pixels.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(limits.PIXEL_STD, device=pixels.device).view(1, -1, 1, 1, 1)
    return (pixels.to(torch.float32).div(255.0) - mean) / std


def video_condition_pixels(frames: np.ndarray) -> torch.Tensor:
    """Reference frames snapped down to 17n + 5 (at least 22) -> uint8 [1, 3, T, H, W]."""
    block, rest = limits.VAE_FRAMES_PER_CHUNK, limits.VAE_LATENTS_PER_CHUNK
    n = max(1, (frames.shape[0] - rest) // block) * block + rest
    return torch.from_numpy(frames[:n].copy()).permute(3, 0, 1, 2)[None]


def image_pixels(img: Image.Image) -> torch.Tensor:
    """PIL RGB -> uint8 [1, 3, 1, H, W]."""
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)[None, :, None]


@torch.no_grad()
def encode_audio_condition(audio_vae, wave: torch.Tensor) -> torch.Tensor:
    """Clean stereo reference audio (2, N) at 32 kHz -> normalised rows (2·La, 32), channel-major, La = ceil(N/800)."""
    device = next(audio_vae.parameters()).device
    posterior = audio_vae.encode(wave.to(device)[:, None], return_dict=False)[0]
    z = posterior.mode().float().cpu().transpose(1, 2)  # (2, La, 32)
    mean = torch.tensor(audio_vae.config.latents_mean).view(1, 1, -1)
    std = torch.tensor(audio_vae.config.latents_std).view(1, 1, -1)
    return ((z - mean) / std).reshape(-1, z.shape[-1])
