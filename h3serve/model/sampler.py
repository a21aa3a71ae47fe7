"""The pipeline's second stage: draw a request's noise and denoise its rows with a DiT, on its own schedules.

Noise comes from one CPU generator in the reference's order (condition noise, video noise, audio noise), so a seed
reproduces the reference pipeline's output.
"""

from __future__ import annotations

import torch

from h3serve.model.adaln_memo import AdaLNMemo, ForwardTimes
from h3serve.model.controlnet import ControlInput
from h3serve.model.latent_edit import MaskedTarget
from h3serve.model.layout import Layout, patchify, unpatchify
from h3serve.model.pipeline_types import (
    Encoded,
    H3Components,
    LatentTarget,
    NoHooks,
    StageClock,
    StageHooks,
    StepCallback,
)
from h3serve.model.scheduler import FlowSchedule, FlowSolver, scale_noise
from h3serve.model.step_times import StepTimes, step_times
from h3serve.model.transformer import H3Transformer
from h3serve.rules import limits
from h3serve.rules.names import DEFAULT_SAMPLE_SOLVER
from h3serve.rules.validate import GenerationPlan


class Sampler:
    """Samples target latents on `device`; with `adaln`, the AdaLN modulations are computed ahead and memoised."""

    def __init__(self, components: H3Components, device: torch.device, adaln: AdaLNMemo | None = None):
        self.components = components
        self.device = device
        self.adaln = adaln

    def schedules(self, plan: GenerationPlan) -> tuple[FlowSchedule, FlowSchedule]:
        """The (video, audio) sigma ladders of the plan: its forward count on each modality's shift."""
        video = FlowSchedule.shifted(plan.steps, plan.flow_shift, plan.pinned_positions)
        audio = FlowSchedule.shifted(plan.steps, plan.audio_flow_shift, plan.pinned_positions)
        if len(video) != len(audio):
            raise ValueError(
                f"video and audio schedules differ in length ({len(video)} vs {len(audio)}) for steps={plan.steps}"
            )
        return video, audio

    def initial_rows(
        self, enc: Encoded, target: LatentTarget, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(video rows, audio rows) at the first step, conditions noised, and the target's (video, audio) noise."""
        # One CPU generator, the reference's draw order: condition noise, then video noise, then audio noise.
        # Conditions may arrive on the host (VAE encodes) or on the device (a continuation window's guide is the
        # previous window's output): each is mixed with its noise on the device, never across devices.
        # Timeline guides (the first `enc.guide_visuals` conditions) draw theirs from a fresh generator each, seeded
        # with the same seed (vLLM-Omni's guided mode): the other draws are those of the request without guides.
        generator = torch.Generator("cpu").manual_seed(seed)
        condition_rows = []
        for index, z in enumerate(enc.visual):
            draw = torch.Generator("cpu").manual_seed(seed) if index < enc.guide_visuals else generator
            noise = torch.randn(z.shape, generator=draw).to(self.device)
            condition_rows.append(patchify(scale_noise(z.to(self.device), limits.KEYFRAME_NOISE_AUG_T, noise)))
        channels = self.components.vae.config.latent_channels
        video_noise = torch.randn(
            (1, channels, target.latent_frames, target.latent_height, target.latent_width), generator=generator
        )
        audio_noise = torch.randn(
            (limits.AUDIO_CHANNELS * target.audio_latents, self.components.audio_vae.config.latent_channels),
            generator=generator,
        )
        video_rows = torch.cat([*condition_rows, patchify(video_noise).to(self.device)])
        audio_rows = torch.cat([r.to(self.device) for r in (*enc.audio_rows, audio_noise)])
        return video_rows, audio_rows, video_noise, audio_noise

    def sample(
        self,
        plan: GenerationPlan,
        enc: Encoded,
        dit: H3Transformer | None,
        target: LatentTarget,
        seed: int,
        clock: StageClock,
        on_step: StepCallback | None,
        edits: tuple[MaskedTarget | None, MaskedTarget | None] = (None, None),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw the noise, denoise, and return the target latents: video [1, 24, F, lh, lw], audio [2, 32, A]."""
        (video, audio), = self.sample_batch(plan, enc, dit, target, (seed,), clock, on_step, edits)
        return video, audio

    def sample_batch(
        self,
        plan: GenerationPlan,
        enc: Encoded,
        dit: H3Transformer | None,
        target: LatentTarget,
        seeds: tuple[int, ...],
        clock: StageClock,
        on_step: StepCallback | None,
        edits: tuple[MaskedTarget | None, MaskedTarget | None] = (None, None),
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`sample` for several seeds at once, one DiT batch: each item's noise is drawn as its own request's
        (so item i is the single request at seeds[i], where the kernels are batch-invariant). Edits run alone."""
        if len(seeds) > 1 and any(edit is not None for edit in edits):
            raise ValueError("a latent-mask edit samples one seed at a time (its anchor is drawn from the noise)")
        drawn = [self.initial_rows(enc, target, seed) for seed in seeds]
        video_rows = torch.stack([d[0] for d in drawn])  # [B, Nv, C·4]
        audio_rows = torch.stack([d[1] for d in drawn])  # [B, Na, 32]
        channels = self.components.vae.config.latent_channels
        for edit, noise in zip(edits, (patchify(drawn[0][2]), drawn[0][3]), strict=True):
            if edit is not None:
                edit.set_anchor(noise)
        if video_rows.shape[1] != enc.layout.packed.video_indices.numel():
            raise ValueError("condition latents do not match the layout (canvas mismatch)")
        if dit is None:
            raise ValueError(f"the {plan.task} DiT is not loaded")
        schedules = self.schedules(plan)
        with clock("denoise"):
            video_rows, audio_rows = self.denoise(
                schedules, dit, enc.layout, enc.text_states, video_rows, audio_rows, on_step, edits,
                solver=plan.sample_solver, hooks=clock.hooks, control=enc.control,
            )
        clock.steps += len(schedules[0])
        layout = enc.layout
        return [
            (
                unpatchify(
                    video[layout.num_video_condition_rows :],
                    channels,
                    target.latent_frames,
                    target.latent_height,
                    target.latent_width,
                ),
                audio[layout.num_audio_reference_rows :]
                .reshape(limits.AUDIO_CHANNELS, target.audio_latents, -1)
                .permute(0, 2, 1)
                .contiguous(),
            )
            for video, audio in zip(video_rows, audio_rows, strict=True)
        ]

    def denoise(
        self,
        schedules: tuple[FlowSchedule, FlowSchedule],  # (video, audio), equal lengths
        transformer: H3Transformer,
        layout: Layout,
        text_states: torch.Tensor,
        video_rows: torch.Tensor,  # [B, Nv, C·4] fp32, condition rows first
        audio_rows: torch.Tensor,  # [B, Na, 32] fp32, reference rows first
        on_step: StepCallback | None = None,
        edits: tuple[MaskedTarget | None, MaskedTarget | None] = (None, None),  # (video, audio) latent-mask edits
        solver: str = DEFAULT_SAMPLE_SOLVER,  # names.SAMPLE_SOLVERS
        hooks: StageHooks | None = None,  # the placement hooks (the AdaLN memo stages its weights through them)
        control: ControlInput | None = None,  # a control video's rows (the DiT's ControlNet branch)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling loop over a batch of B items that share the request (B > 1: several outputs of one
        prompt, each its own noise). Only target rows are stepped; condition rows stay as given. Each modality has
        its own solver state on its own schedule; every step is elementwise, so an item steps as it would alone.

        Everything a step reads that is not a latent (timesteps, row indices, sigmas, solver weights) moves to
        the device once, before the loop: a step issues no host -> device copy and no synchronisation."""
        times = step_times(schedules, layout, edits, self.device)
        video_solver, audio_solver = (FlowSolver(s, solver, self.device) for s in schedules)
        packed = layout.packed.to(self.device)
        text = transformer.embed_text(text_states.to(self.device))  # once per request, not per step
        text = text.expand(video_rows.shape[0], -1, -1)  # [B, L, D]: the same prompt for every item
        nv, na = layout.num_video_condition_rows, layout.num_audio_reference_rows
        video_edit, audio_edit = [None if e is None else e.to(self.device) for e in edits]
        total = len(times)
        modulations = self._modulations(transformer, times, layout, hooks or NoHooks())
        for i in range(total):
            video_in, audio_in = video_rows, audio_rows
            if video_edit is not None:  # latent-mask editing: the model reads the anchored blend
                video_in = torch.cat([video_rows[:, :nv], video_edit.model_input(video_rows[:, nv:])], dim=1)
            if audio_edit is not None:
                audio_in = torch.cat([audio_rows[:, :na], audio_edit.model_input(audio_rows[:, na:])], dim=1)
            step_mod = None if modulations is None else modulations[i]
            v_vel, a_vel = transformer(
                video_in, audio_in, text, times.timesteps[i], times.row_index[i], packed, step_mod, step=i,
                control=control,
            )
            for step, rows, model_in, vel, n, edit in (
                (video_solver, video_rows, video_in, v_vel, nv, video_edit),
                (audio_solver, audio_rows, audio_in, a_vel, na, audio_edit),
            ):
                if edit is None:
                    rows[:, n:] = step.step(vel[:, n:], i, rows[:, n:])
                else:  # the step starts from the un-blended state, towards the restored clean estimate
                    t = step.schedule.timesteps[i].to(rows.device, rows.dtype)
                    rows[:, n:] = step.step_from_x0(edit.clean_estimate(model_in[:, n:], vel[:, n:], t), i, rows[:, n:])
            if on_step is not None:
                on_step(i + 1, total)
        return video_rows, audio_rows

    def _modulations(self, transformer: H3Transformer, times: StepTimes, layout: Layout, hooks: StageHooks):
        """The request's AdaLN modulations, one per step (None when memoisation is off)."""
        if self.adaln is None:
            return None
        steps = [ForwardTimes(times.timesteps[i], times.row_index[i]) for i in range(len(times))]
        name = "transformer_ref" if transformer is self.components.transformer_ref else "transformer"
        tags = layout.packed.token_tags
        return self.adaln.prepare(
            name, transformer, steps, tags, self.device, hooks.weights, adapter=transformer.adaln_adapter
        )
