"""Every denoise step's timestep inputs, computed on the host once per request and moved to the device once.

Per step the DiT reads the distinct timesteps of the rows and each row's index into them; latent-mask editing
changes the target rows' timesteps. Built inside the loop, that was two small unpinned host -> device copies per
step (and an edit's mask read back from the device): on a GPU each is a synchronising stall between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3serve.model.latent_edit import MaskedTarget
from h3serve.model.layout import Layout, Role
from h3serve.model.scheduler import FlowSchedule
from h3serve.rules import limits


@dataclass(frozen=True)
class StepTimes:
    """Step i's DiT inputs: `timesteps[i]` [T_i] distinct timesteps, `row_index[i]` [S] row -> index into them."""

    timesteps: tuple[torch.Tensor, ...]  # views of one device tensor
    row_index: torch.Tensor  # [steps, S] int64 on the device

    def __len__(self) -> int:
        return len(self.timesteps)


def step_times(
    schedules: tuple[FlowSchedule, FlowSchedule],  # (video, audio) on the host
    layout: Layout,
    edits: tuple[MaskedTarget | None, MaskedTarget | None],  # on the host
    device: torch.device,
) -> StepTimes:
    """Row timesteps of every step (conditions at the noise-augmentation t, edits per row), in two transfers."""
    video_sched, audio_sched = schedules
    video_edit, audio_edit = edits
    distinct, indices = [], []
    for i in range(len(video_sched)):
        t_video, t_audio = float(video_sched.timesteps[i]), float(audio_sched.timesteps[i])
        row_t = layout.row_times(t_video, t_audio, limits.KEYFRAME_NOISE_AUG_T)
        if video_edit is not None:  # latent-mask editing: the model reads the anchored blend, at per-row t
            row_t[layout.roles == Role.VIDEO] = video_edit.row_times(t_video)
        if audio_edit is not None:
            row_t[layout.roles == Role.AUDIO] = audio_edit.row_times(t_audio)
        timestep, row_index = torch.unique(row_t, sorted=True, return_inverse=True)
        distinct.append(timestep)
        indices.append(row_index)
    flat = torch.cat(distinct).to(device)
    return StepTimes(tuple(flat.split([t.numel() for t in distinct])), torch.stack(indices).to(device))
