"""The condition recipe's VAE encode, one clip at a time: the same latents as encoding the whole video at once."""

from __future__ import annotations

import pytest
import torch

from h3serve.model.conditioning import encode_visual_condition
from h3serve.rules import limits


def _whole_video_recipe(vae, pixels: torch.Tensor) -> torch.Tensor:
    """The recipe as one `vae.encode` of the whole normalised video (what h3serve did before it went by clips)."""
    mean = torch.tensor(limits.PIXEL_MEAN).view(1, -1, 1, 1, 1)
    std = torch.tensor(limits.PIXEL_STD).view(1, -1, 1, 1, 1)
    x = (pixels.to(torch.float32).div(255.0) - mean) / std
    posterior = vae.encode(x, return_dict=False)[0]
    z = posterior.sample(generator=torch.Generator().manual_seed(limits.KEYFRAME_ENCODE_SEED))
    z = z.to(torch.float16).float()
    z_mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    z_std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z - z_mean) / z_std


@pytest.mark.parametrize("frames", [1, 22, 39, 56])  # a keyframe; 1, 2 and 3 clips, the last one padded
def test_clip_by_clip_encoding_is_bit_identical_to_the_whole_video(tiny_pipeline, frames):
    vae = tiny_pipeline[0].components.vae
    pixels = torch.randint(0, 256, (1, 3, frames, 64, 96), generator=torch.Generator().manual_seed(frames),
                           dtype=torch.uint8)
    assert torch.equal(encode_visual_condition(vae, pixels), _whole_video_recipe(vae, pixels))


TILING = ("use_tiling", "tile_sample_min_height", "tile_sample_min_width", "tile_sample_min_overlap_height",
          "tile_sample_min_overlap_width")


@pytest.mark.parametrize("tiles", ["small", "off"])
def test_clip_by_clip_encoding_with_spatial_tiles_or_none(tiny_pipeline, tiles):
    vae = tiny_pipeline[0].components.vae
    shared = {name: getattr(vae, name) for name in TILING}  # the session's pipeline: put back as it was
    if tiles == "small":
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=64, tile_sample_min_overlap_height=16,
                          tile_sample_min_overlap_width=16)
    else:
        vae.disable_tiling()
    try:
        pixels = torch.randint(0, 256, (1, 3, 39, 64, 96), generator=torch.Generator().manual_seed(1),
                               dtype=torch.uint8)
        assert torch.equal(encode_visual_condition(vae, pixels), _whole_video_recipe(vae, pixels))
    finally:
        for name, value in shared.items():
            setattr(vae, name, value)
