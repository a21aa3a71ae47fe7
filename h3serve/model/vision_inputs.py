"""Qwen3-VL vision inputs without torchvision: images and Ref2VA video frames -> pixel values and grids (docs/model.md
§7, §8).

- Images follow `transformers.Qwen2VLImageProcessorPil` bit for bit: `smart_resize` to multiples of
  patch_size * merge_size within [min_pixels, max_pixels], PIL resize, rescale in float64, normalise in float32,
  the single frame repeated `temporal_patch_size` times, patches flattened in merge-window order.
  `backend="torchvision"` follows transformers' torchvision `Qwen2VLImageProcessor` on CPU instead (the class
  `AutoProcessor` picks when torchvision is installed).
- Videos follow `Qwen3VLVideoProcessor(..., do_sample_frames=False)` on CPU tensors: the frames given are the ones
  encoded (sampling at 2 fps is the caller's), `smart_resize` over the whole clip's pixel budget, torchvision's
  CPU resize, which is `F.interpolate` on the uint8 tensor (bicubic, antialias, native uint8 kernel), rescale and
  normalise fused as `(x - mean·255) / (std·255)` in float32, the last frame repeated up to a multiple of
  `temporal_patch_size`, one grid row (T / 2, H / 16, W / 16) per video.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

_PIL_BICUBIC = 3

# transformers' class defaults, used only for keys a checkpoint's config leaves out.
_IMAGE_DEFAULTS: dict[str, Any] = {  # Qwen2VLImageProcessorPil
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    "image_mean": (0.48145466, 0.4578275, 0.40821073),  # OPENAI_CLIP_MEAN
    "image_std": (0.26862954, 0.26130258, 0.27577711),  # OPENAI_CLIP_STD
}
_VIDEO_DEFAULTS: dict[str, Any] = {  # Qwen3VLVideoProcessor
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    "image_mean": (0.5, 0.5, 0.5),  # IMAGENET_STANDARD_MEAN
    "image_std": (0.5, 0.5, 0.5),
}


@dataclass(frozen=True)
class ProcessorParams:
    """The settings of one Qwen processor (image or video), as the checkpoint's config gives them."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int  # size["shortest_edge"]: a pixel budget, not an edge
    max_pixels: int  # size["longest_edge"]
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float = 1 / 255
    resample: int = _PIL_BICUBIC  # a PIL resampling filter id
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    cap_pixels_per_frame: bool = False  # video only; transformers treats an unset value as False
    max_video_tokens: int = 768  # video only, used with cap_pixels_per_frame

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict[str, Any], defaults: dict[str, Any], legacy_pixels: bool = False) -> ProcessorParams:
        """`legacy_pixels`: top-level min_pixels / max_pixels override `size`, as the image processor allows."""
        size = dict(d.get("size") or defaults["size"])
        if legacy_pixels and d.get("min_pixels") is not None:
            size["shortest_edge"] = d["min_pixels"]
        if legacy_pixels and d.get("max_pixels") is not None:
            size["longest_edge"] = d["max_pixels"]

        def get(key: str, default: Any) -> Any:
            value = d.get(key)
            return default if value is None else value

        return cls(
            patch_size=int(get("patch_size", defaults["patch_size"])),
            temporal_patch_size=int(get("temporal_patch_size", defaults["temporal_patch_size"])),
            merge_size=int(get("merge_size", defaults["merge_size"])),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            image_mean=tuple(float(v) for v in get("image_mean", defaults["image_mean"])),
            image_std=tuple(float(v) for v in get("image_std", defaults["image_std"])),
            rescale_factor=float(get("rescale_factor", 1 / 255)),
            resample=int(get("resample", _PIL_BICUBIC)),
            do_resize=bool(get("do_resize", True)),
            do_rescale=bool(get("do_rescale", True)),
            do_normalize=bool(get("do_normalize", True)),
            do_convert_rgb=bool(get("do_convert_rgb", True)),
            cap_pixels_per_frame=bool(get("cap_pixels_per_frame", False)),
            max_video_tokens=int(get("max_video_tokens", 768)),
        )


@dataclass(frozen=True)
class VisionProcessorConfig:
    """The checkpoint's Qwen3-VL processor settings: one set for images, one for videos."""

    image: ProcessorParams
    video: ProcessorParams

    @property
    def merge_size(self) -> int:
        """The image processor's merge size, which diffusers uses to count image and video tokens alike."""
        return self.image.merge_size

    @classmethod
    def from_dict(cls, d: dict[str, Any], video: dict[str, Any] | None = None) -> VisionProcessorConfig:
        """A nested `processor_config.json` dict ({"image_processor": ..., "video_processor": ...}), or a flat
        image processor dict (`preprocessor_config.json`) with an optional flat video one (else the image one)."""
        if "image_processor" in d or "video_processor" in d:
            image_dict, video_dict = d.get("image_processor", {}), d.get("video_processor", {})
        else:
            image_dict, video_dict = d, d if video is None else video
        return cls(
            image=ProcessorParams.from_dict(image_dict, _IMAGE_DEFAULTS, legacy_pixels=True),
            video=ProcessorParams.from_dict(video_dict, _VIDEO_DEFAULTS),
        )


# --------------------------------------------------------------------------------------------------------------------
# Sizes


def smart_resize_image(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's image rule: both edges multiples of `factor`, area within [min_pixels, max_pixels], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's video rule: like the image rule, but the pixel budget covers all frames of the clip."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _video_max_pixels(p: ProcessorParams, num_frames: int) -> int:
    if not p.cap_pixels_per_frame:
        return p.max_pixels
    frame_cap = p.max_video_tokens * p.factor * p.factor
    return max(min(frame_cap, p.max_pixels // num_frames), int(p.min_pixels * 1.05)) * num_frames


def num_vision_tokens(grid_thw: Any, merge_size: int) -> int:
    """Placeholder tokens for one grid row [t, h, w] (or the sum over rows): t·h·w / merge_size²."""
    grid = torch.as_tensor(grid_thw).reshape(-1, 3).to(torch.int64)
    return int(grid.prod(dim=1).sum()) // merge_size**2


# --------------------------------------------------------------------------------------------------------------------
# Pixels


def _to_rgb(img: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb`: transparency is composited onto white, everything else converted."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def _resize_uint8(x: torch.Tensor, height: int, width: int, resample: int) -> torch.Tensor:
    """torchvision's `resize` of a contiguous (N, C, H, W) uint8 CPU tensor: bicubic runs natively on uint8."""
    if resample != _PIL_BICUBIC:
        raise NotImplementedError(f"only bicubic resampling (3) is implemented for tensors, got {resample}")
    if tuple(x.shape[-2:]) == (height, width):
        return x
    return F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)


def _normalize_tensor(x: torch.Tensor, p: ProcessorParams) -> torch.Tensor:
    """transformers' TorchvisionBackend.rescale_and_normalize (fused when both are on)."""
    if p.do_normalize:
        mean, std = torch.tensor(p.image_mean), torch.tensor(p.image_std)
        if p.do_rescale:
            mean, std = mean * (1.0 / p.rescale_factor), std * (1.0 / p.rescale_factor)
        return x.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    return x * p.rescale_factor if p.do_rescale else x


def _patchify(frames: torch.Tensor, p: ProcessorParams) -> tuple[torch.Tensor, list[int]]:
    """(T, C, H, W) -> ([grid_t·grid_h·grid_w, C·tp·ps·ps], [grid_t, grid_h, grid_w]).

    Rows run over temporal blocks, then merge windows (row-major), then the merge_size² patches inside a window
    (row-major); a row's features are channel, then frame in the block, then the patch's pixels. The last frame is
    repeated up to a multiple of the temporal patch.
    """
    ps, ms, tp = p.patch_size, p.merge_size, p.temporal_patch_size
    if pad := -frames.shape[0] % tp:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    t, c, h, w = frames.shape
    if h % p.factor or w % p.factor:
        raise ValueError(f"frames of {h}x{w} are not multiples of patch_size * merge_size = {p.factor}")
    gt, gh, gw = t // tp, h // ps, w // ps
    patches = frames.reshape(gt, tp, c, gh // ms, ms, ps, gw // ms, ms, ps)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * tp * ps * ps), [gt, gh, gw]


def preprocess_image(
    img: Image.Image, cfg: VisionProcessorConfig, backend: Literal["pil", "torchvision"] = "pil"
) -> dict[str, torch.Tensor]:
    """One image -> {"pixel_values": [gh·gw, 3·tp·ps·ps] float32, "image_grid_thw": [[1, gh, gw]] int64}."""
    p = cfg.image
    if p.do_convert_rgb:
        img = _to_rgb(img)
    height, width = img.height, img.width
    if p.do_resize:
        height, width = smart_resize_image(height, width, p.factor, p.min_pixels, p.max_pixels)
    if backend == "pil":
        if p.do_resize:
            img = img.resize((width, height), resample=p.resample)
        x = np.moveaxis(np.asarray(img), -1, 0)
        if p.do_rescale:
            x = (x.astype(np.float64) * p.rescale_factor).astype(np.float32)
        if p.do_normalize:
            mean = np.asarray(p.image_mean, np.float32)[:, None, None]
            std = np.asarray(p.image_std, np.float32)[:, None, None]
            x = (x.astype(np.float32, copy=False) - mean) / std
        frames = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None]
    elif backend == "torchvision":
        x = torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()[None]
        if p.do_resize:
            x = _resize_uint8(x, height, width, p.resample)
        frames = _normalize_tensor(x, p)
    else:
        raise ValueError(f"backend must be 'pil' or 'torchvision', got {backend!r}")
    patches, grid = _patchify(frames, p)
    return {"pixel_values": patches, "image_grid_thw": torch.tensor([grid], dtype=torch.int64)}


def preprocess_video(frames: np.ndarray, cfg: VisionProcessorConfig) -> dict[str, torch.Tensor]:
    """The sampled frames of one video, (T, H, W, 3) uint8 with T >= temporal_patch_size ->
    {"pixel_values_videos": [gt·gh·gw, 3·tp·ps·ps] float32, "video_grid_thw": [[gt, gh, gw]] int64}.

    Several videos: call once per video and concatenate both outputs along dim 0, in request order.
    """
    p = cfg.video
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected (T, H, W, 3) uint8 frames, got {frames.dtype} {frames.shape}")
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    num_frames, height, width = frames.shape[:3]
    if p.do_resize:
        max_pixels = _video_max_pixels(p, num_frames)
        height, width = smart_resize_video(
            num_frames, height, width, p.temporal_patch_size, p.factor, p.min_pixels, max_pixels
        )
        x = _resize_uint8(x, height, width, p.resample)
    patches, grid = _patchify(_normalize_tensor(x, p), p)
    return {"pixel_values_videos": patches, "video_grid_thw": torch.tensor([grid], dtype=torch.int64)}
