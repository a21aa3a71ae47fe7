"""A real-time request's noise: the standalone request's draw (37 video latents, then 207 audio latents per channel,
from one CPU generator), audio under seed + k and video under seed + k·1000003, less the prefix a later request
inherits instead of generating (vLLM-Omni's `official_request_noise`)."""

from __future__ import annotations

import torch

from h3serve.model.layout import patchify
from h3serve.rules import limits
from h3serve.rules.realtime_geometry import REQUEST_AUDIO_LATENTS, REQUEST_VIDEO_LATENTS, VIDEO_SEED_STRIDE

LATENT_CHANNELS, AUDIO_CHANNELS_PER_ROW = 24, 32


def _draw(seed: int, latent_h: int, latent_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(video [1, 24, 37, lh, lw], audio rows [2·207, 32]) of one generator at `seed`, video first."""
    generator = torch.Generator("cpu").manual_seed(seed)
    video = torch.randn((1, LATENT_CHANNELS, REQUEST_VIDEO_LATENTS, latent_h, latent_w), generator=generator)
    audio = torch.randn((limits.AUDIO_CHANNELS * REQUEST_AUDIO_LATENTS, AUDIO_CHANNELS_PER_ROW), generator=generator)
    return video, audio


def request_noise(
    seed: int, request: int, video_latents: int, audio_latents: int, latent_h: int, latent_w: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request `request`'s initial rows: video [video_latents·rows, 96] (patchified) and audio
    [2, audio_latents, 32] (channel-major), the last `video_latents` / `audio_latents` of the standalone draw."""
    video, _ = _draw((seed + request * VIDEO_SEED_STRIDE) % 2**63, latent_h, latent_w)
    _, audio = _draw(seed + request, latent_h, latent_w)
    rows = patchify(video[:, :, REQUEST_VIDEO_LATENTS - video_latents :])
    audio = audio.view(limits.AUDIO_CHANNELS, REQUEST_AUDIO_LATENTS, -1)[:, REQUEST_AUDIO_LATENTS - audio_latents :]
    return rows, audio.contiguous()
