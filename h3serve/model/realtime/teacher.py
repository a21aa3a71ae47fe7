"""The audio of a real-time request, made by the base model (the streaming LoRA off), as TaoMate-H3 does.

For each request the base DiT runs the whole 10-point audio ladder (nine audio-only forwards) over
[text | the previous request's last 40 clean latents (t = 1) | the request's audio noise]; its states 3, 6 and 9
replace the student's audio rows after each of a chunk's three steps, so the published audio is the base model's
and continues across requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3serve.model.realtime.chunk_layout import teacher_layout
from h3serve.model.realtime.student_schedule import euler_, teacher_sigmas
from h3serve.model.transformer import H3Transformer
from h3serve.rules import limits
from h3serve.rules.realtime_geometry import ROLLOVER_LATENTS, TEACHER_STATES


@dataclass(frozen=True)
class TeacherAudio:
    """A request's audio at teacher states 3, 6 and 9, each [2, A, 32] (channel-major); the last is clean."""

    states: tuple[torch.Tensor, ...]

    @property
    def clean(self) -> torch.Tensor:
        return self.states[-1]


@torch.no_grad()
def teach(
    dit: H3Transformer,
    text: torch.Tensor,  # [1, L, D]: the prompt refined by the base model's token refiner
    tags: torch.Tensor,  # [L]
    noise: torch.Tensor,  # [2, A, 32]
    previous: torch.Tensor | None,  # the previous request's clean audio [2, P, 32]; None for the first request
    latent_h: int,
    latent_w: int,
) -> TeacherAudio:
    """Nine base-model forwards over the request's audio; the caller has switched the streaming LoRA off."""
    device = text.device
    channels, latents, width = noise.shape
    layout = teacher_layout(tags, latent_h, latent_w, latents, None if previous is None else previous.shape[1])
    packed = layout.packed.to(device)
    reference = layout.num_audio_reference_rows
    rows = noise.reshape(-1, width)
    if previous is not None:
        rows = torch.cat([previous[:, -ROLLOVER_LATENTS:].reshape(-1, width), rows.to(previous.device)])
    audio = rows.to(device=device, dtype=torch.float32)
    target = audio[reference:]  # a view: the Euler steps update the target rows in place
    video = audio.new_zeros((1, 0, 4 * dit.config.in_channels))
    sigma_video, sigma_audio = teacher_sigmas()
    states = []
    for step in range(len(sigma_audio) - 1):
        timestep, row_index = layout.row_timesteps(1.0 - sigma_video[step], 1.0 - sigma_audio[step])
        _, velocity = dit(video, audio[None], text, timestep.to(device), row_index.to(device), packed)
        euler_(target, velocity[0, reference:].float(), sigma_audio[step], sigma_audio[step + 1])
        if step + 1 in TEACHER_STATES:
            states.append(target.reshape(limits.AUDIO_CHANNELS, latents, width).clone())
    return TeacherAudio(tuple(states))
