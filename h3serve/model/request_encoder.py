"""The pipeline's first stage: a request's presentation and text states, its condition latents and the packed
layout, a control video's rows; and the latents of an edit's or an extension's source."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from h3serve.model.conditioning import (
    Presentation,
    Reference,
    encode_audio_condition,
    encode_control_video,
    encode_visual_condition,
)
from h3serve.model.controlnet import ControlInput, control_rows
from h3serve.model.encode_inputs import keyframes_encoded, presentation, reference_encoded, reference_media
from h3serve.model.latent_edit import MaskedTarget, audio_target, video_target
from h3serve.model.pipeline_types import (
    Conditioning,
    ControlPixels,
    Encoded,
    H3Components,
    LatentTarget,
    ReferenceMedia,
    StageClock,
)
from h3serve.rules import limits
from h3serve.rules.validate import GenerationPlan


class RequestEncoder:
    """Encodes with the components' text encoder and VAEs on `device`."""

    def __init__(self, components: H3Components, device: torch.device):
        self.components = components
        self.device = device

    def encode(self, plan: GenerationPlan, cond: Conditioning, clock: StageClock) -> Encoded:
        """Presentation -> text states, condition latents and the packed layout."""
        if cond.references:
            media = self.reference_media(cond.references, clock)
            target = LatentTarget.of(plan)
            return reference_encoded(self.components, media, self.presentation(media, plan.prompt), target, clock)
        enc = keyframes_encoded(self.components, self.device, plan, cond.keyframes, cond.anchors, clock)
        if cond.control is not None:
            enc.control = self.control_input(plan, cond.control, clock)
        return enc

    def control_input(self, plan: GenerationPlan, media: ControlPixels, clock: StageClock) -> ControlInput:
        """The control rows [1, Nv, 196] (control latents | visibility | masked-source latents, posterior modes):
        without a mask the last 100 columns are zero; a mask without a source encodes a black source."""
        vae = self.components.vae
        grid = (plan.latent_frames, plan.latent_height, plan.latent_width)
        with clock("vae_encode"):
            control = None if media.control is None else encode_control_video(vae, media.control, self.device)
            visible = source = None
            if media.mask is not None:
                keep = 1.0 - media.mask
                pixels = torch.zeros_like(keep.expand(-1, 3, -1, -1, -1)) if media.source is None else media.source
                source = encode_control_video(vae, pixels * keep, self.device)
                visible = F.interpolate(keep, size=grid, mode="trilinear", align_corners=False)
        rows = control_rows(control, visible, source, grid).to(self.device)  # once: a step copies nothing up
        return ControlInput(rows, media.scale)

    def reference_media(self, refs: list[Reference], clock: StageClock) -> ReferenceMedia:
        return reference_media(self.components, self.device, refs, clock)

    def presentation(self, media: ReferenceMedia, prompt: str) -> Presentation:
        return presentation(self.components, media, prompt)

    def edit_targets(
        self, plan: GenerationPlan, cond: Conditioning, clock: StageClock
    ) -> tuple[MaskedTarget | None, MaskedTarget | None]:
        """The sources' clean latents and the masks as packed target rows (h3serve/model/latent_edit.py).

        Source audio is cropped or zero-padded per channel to the target length; a padded tail is generated
        (mask 1), except under lock_source, where the driving audio (silence past its end) is held whole."""
        video = audio = None
        with clock("vae_encode"):
            if plan.video_mask is not None:
                if cond.edit_video is None:
                    raise ValueError("a video mask needs the decoded source video")
                clean = self.source_frames(cond.edit_video)
                expected = (plan.latent_frames, plan.latent_height, plan.latent_width)
                if tuple(clean.shape[2:]) != expected:
                    raise ValueError(f"the source video encodes to {tuple(clean.shape[2:])} latents, not {expected}")
                video = video_target(clean, torch.from_numpy(plan.video_mask.array()))
            if plan.audio_mask is not None:
                clean, length = self.source_audio_latents(plan, cond)
                grid = torch.from_numpy(plan.audio_mask.array())
                if plan.audio_mode != "lock_source":
                    grid[:, length:] = 1.0  # a padded tail is generated
                audio = audio_target(clean.reshape(-1, clean.shape[-1]), grid)
        return video, audio

    def source_audio_latents(self, plan: GenerationPlan, cond: Conditioning) -> tuple[torch.Tensor, int]:
        """The edit's (or lock_source's) audio as normalised latents [2, A, 32] zero-padded to the request, and
        how many of them the source covers."""
        if cond.edit_audio is None:
            raise ValueError("an audio mask needs the decoded source audio")
        return self.padded_audio_latents(cond.edit_audio, plan.audio_latents)

    def source_frames(self, frames: np.ndarray) -> torch.Tensor:
        """Decoded source frames [T, H, W, 3] uint8 -> normalised latents [1, 24, F, lh, lw] (the condition recipe);
        the frames stay in host memory, one VAE clip at a time goes to the device."""
        pixels = torch.from_numpy(frames).permute(3, 0, 1, 2)[None]
        return encode_visual_condition(self.components.vae, pixels, self.device)

    def padded_audio_latents(self, waveform: torch.Tensor, length: int) -> tuple[torch.Tensor, int]:
        """A source waveform [2, N] -> normalised latents [2, length, 32], cropped or zero-padded, and how many of
        them the source covers."""
        rows = encode_audio_condition(self.components.audio_vae, waveform)
        source = rows.reshape(limits.AUDIO_CHANNELS, -1, rows.shape[-1])[:, :length]
        clean = torch.zeros(limits.AUDIO_CHANNELS, length, rows.shape[-1])
        clean[:, : source.shape[1]] = source
        return clean, source.shape[1]
