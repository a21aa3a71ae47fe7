"""Qwen3-VL vision inputs without torchvision, against transformers' own processors."""

from __future__ import annotations

import enum
import json
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from h3serve.loading.components import read_vision_config
from h3serve.model.vision_inputs import (
    VisionProcessorConfig,
    num_vision_tokens,
    preprocess_image,
    preprocess_video,
)

# Released Qwen3-VL settings (patch 16, 2x2 merge, mean/std 0.5) with a real-sized budget, and a Qwen2-VL style
# config (patch 14, CLIP mean/std, legacy min_pixels / max_pixels keys): both differ from the tiny checkpoint's.
QWEN3_IMAGE = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
QWEN2_IMAGE = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64}

SIZES = [(64, 64), (300, 200), (20, 30), (100, 37), (256, 640), (1000, 998)]  # no resize, down, up, odd aspects


def _image(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
    return img if mode == "RGBA" else img.convert(mode)


@pytest.fixture(scope="module")
def tiny_cfg(tiny_checkpoint) -> VisionProcessorConfig:
    return read_vision_config(tiny_checkpoint)


@pytest.mark.parametrize("config", ["tiny", "qwen3", "qwen2"])
def test_images_equal_transformers_pil_processor(tiny_checkpoint, tiny_cfg, config):
    if config == "tiny":
        reference, cfg = Qwen2VLImageProcessorPil.from_pretrained(tiny_checkpoint / "processor"), tiny_cfg
    else:
        settings = QWEN3_IMAGE if config == "qwen3" else QWEN2_IMAGE
        reference, cfg = Qwen2VLImageProcessorPil(**settings), VisionProcessorConfig.from_dict(dict(settings))
    cases = [(w, h, "RGB") for w, h in SIZES] + [(90, 70, "RGBA"), (90, 70, "L"), (90, 70, "P")]
    for i, (w, h, mode) in enumerate(cases):
        img = _image(w, h, mode, seed=i)
        ours = preprocess_image(img, cfg)
        theirs = reference(images=img, return_tensors="pt")
        assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"]), (config, w, h, mode)
        assert ours["pixel_values"].dtype == torch.float32
        assert torch.equal(ours["pixel_values"], theirs["pixel_values"]), (config, w, h, mode)
        tokens = reference.get_number_of_image_patches(h, w) // reference.merge_size**2
        assert num_vision_tokens(ours["image_grid_thw"], cfg.image.merge_size) == tokens


def test_token_count_is_grid_product_over_merge_area():
    assert num_vision_tokens([1, 4, 6], 2) == 6
    assert num_vision_tokens(torch.tensor([[3, 6, 10]]), 2) == 45
    assert num_vision_tokens([[1, 4, 4], [2, 2, 2]], 2) == 6  # summed over rows


def test_torchvision_backend_shares_the_grid_and_stays_close(tiny_cfg):
    img = _image(300, 200)
    pil, tv = preprocess_image(img, tiny_cfg), preprocess_image(img, tiny_cfg, backend="torchvision")
    assert torch.equal(pil["image_grid_thw"], tv["image_grid_thw"])
    # Different bicubic kernels on noise; without a resize only the float rounding of the normalisation differs.
    assert (pil["pixel_values"] - tv["pixel_values"]).abs().mean() < 0.1
    same = _image(64, 64)
    pil, tv = preprocess_image(same, tiny_cfg), preprocess_image(same, tiny_cfg, backend="torchvision")
    assert torch.allclose(pil["pixel_values"], tv["pixel_values"], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# Videos


class _Mode(enum.Enum):
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def _tv_resize(image: torch.Tensor, size, interpolation, antialias: bool = True) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize_image on CPU, bicubic: the uint8 tensor is interpolated natively."""
    shape = image.shape
    if tuple(size) == tuple(shape[-2:]):
        return image
    assert interpolation is _Mode.BICUBIC and image.dtype == torch.uint8
    out = F.interpolate(image.reshape(-1, *shape[-3:]), size=list(size), mode="bicubic", align_corners=False,
                        antialias=antialias)  # fmt: skip
    return out.reshape(*shape[:-2], *out.shape[-2:])


def _tv_normalize(image: torch.Tensor, mean, std, inplace: bool = False) -> torch.Tensor:
    """torchvision.transforms.v2.functional.normalize_image."""
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)


@pytest.fixture
def video_processor(monkeypatch, tiny_checkpoint):
    """transformers' Qwen3VLVideoProcessor run for real, with the two torchvision kernels it calls (resize,
    normalize) stood in for by their torchvision definitions on CPU. Everything else is transformers' code: the
    clip-wide smart_resize, the fused mean/std, padding, patch order and grid."""
    from transformers import image_processing_backends as backends
    from transformers.image_utils import PILImageResampling

    shim = types.SimpleNamespace(InterpolationMode=_Mode, resize=_tv_resize, normalize=_tv_normalize)
    monkeypatch.setattr(backends, "tvF", shim, raising=False)
    monkeypatch.setattr(backends, "pil_torch_interpolation_mapping", {PILImageResampling.BICUBIC: _Mode.BICUBIC})
    return Qwen3VLVideoProcessor.from_pretrained(tiny_checkpoint / "processor")


@pytest.mark.parametrize("cap", [False, True])
def test_videos_equal_transformers_video_processor(video_processor, tiny_cfg, cap):
    cfg = tiny_cfg
    if cap:
        video_processor.cap_pixels_per_frame = True
        cfg = VisionProcessorConfig(
            tiny_cfg.image, type(tiny_cfg.video)(**{**vars(tiny_cfg.video), "cap_pixels_per_frame": True})
        )
    rng = np.random.default_rng(1)
    for shape in [(5, 90, 160, 3), (4, 64, 64, 3), (2, 300, 120, 3), (7, 33, 50, 3), (12, 144, 256, 3)]:
        frames = rng.integers(0, 256, shape, dtype=np.uint8)
        ours = preprocess_video(frames, cfg)
        theirs = video_processor(videos=[frames], do_sample_frames=False, do_convert_rgb=False, return_tensors="pt")
        assert torch.equal(ours["video_grid_thw"], theirs["video_grid_thw"]), shape
        assert torch.equal(ours["pixel_values_videos"], theirs["pixel_values_videos"]), shape


def test_video_patch_order_and_odd_frame_padding(tiny_cfg):
    """Independent of transformers: 3 frames of 64x64 (no resize) -> 2 temporal blocks, the last frame repeated."""
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 256, (3, 64, 64, 3), dtype=np.uint8)
    out = preprocess_video(frames, tiny_cfg)
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]
    pv = out["pixel_values_videos"]
    assert pv.shape == (2 * 4 * 4, 3 * 2 * 16 * 16)
    norm = (torch.from_numpy(frames).permute(0, 3, 1, 2).float() - 127.5) / 127.5  # (T, C, H, W)

    def patch(t0: int, y: int, x: int) -> torch.Tensor:  # features: channel, frame in the block, pixel row, column
        return norm[[t0, min(t0 + 1, 2)], :, y : y + 16, x : x + 16].permute(1, 0, 2, 3).reshape(-1)

    # Rows: temporal block, then 2x2 merge windows row-major, then the 4 patches of a window row-major.
    assert torch.allclose(pv[0], patch(0, 0, 0), atol=1e-6)
    assert torch.allclose(pv[1], patch(0, 0, 16), atol=1e-6)
    assert torch.allclose(pv[2], patch(0, 16, 0), atol=1e-6)
    assert torch.allclose(pv[4], patch(0, 0, 32), atol=1e-6)  # second merge window, to the right
    assert torch.allclose(pv[8], patch(0, 32, 0), atol=1e-6)  # third window, next window row
    assert torch.allclose(pv[16], patch(2, 0, 0), atol=1e-6)  # second block: frame 2 twice
    with pytest.raises(ValueError, match="temporal_factor"):
        preprocess_video(frames[:1], tiny_cfg)


def test_config_reads_legacy_flat_files(tmp_path, tiny_checkpoint, tiny_cfg):
    nested = json.loads((tiny_checkpoint / "processor" / "processor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(nested["image_processor"]))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(nested["video_processor"]))
    assert read_vision_config(tmp_path) == tiny_cfg
    (tmp_path / "video_preprocessor_config.json").unlink()  # transformers then reads the image file for videos too
    assert read_vision_config(tmp_path).video.max_pixels == tiny_cfg.image.max_pixels
