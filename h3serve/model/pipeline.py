"""The H3 generation pipeline: encode text -> lay out rows -> denoise -> decode video and audio.

One `GenerationPlan` in, one `GenerationResult` out. The components are plain torch modules; loading
them is `h3serve.rank.checkpoint`'s job. Noise is drawn from one CPU generator in the reference's order
(condition noise, video noise, audio noise), so a seed reproduces the reference pipeline's output.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from h3serve.model.adaln_memo import AdaLNMemo, ForwardTimes
from h3serve.model.conditioning import (
    Presentation,
    Reference,
    encode_audio_condition,
    encode_visual_condition,
)
from h3serve.model.continuation import ContinuationMixin
from h3serve.model.decoder import Decoder, SourceHead
from h3serve.model.encode_inputs import keyframes_encoded, presentation, reference_encoded, reference_media
from h3serve.model.latent_edit import MaskedTarget, audio_target, video_target
from h3serve.model.layout import (
    Layout,
    patchify,
    unpatchify,
)
from h3serve.model.pipeline_types import (
    BlockCache,
    CacheStats,
    Conditioning,
    Encoded,
    FrameSink,
    GenerationResult,
    H3Components,
    NoHooks,
    ReferenceMedia,
    StageClock,
    StageHooks,
    StepCallback,
    Target,
)
from h3serve.model.scheduler import FlowSchedule, FlowSolver, scale_noise
from h3serve.model.step_times import StepTimes, step_times
from h3serve.model.transformer import H3Transformer, PackedLayout
from h3serve.rules import limits
from h3serve.rules.names import DEFAULT_SAMPLE_SOLVER
from h3serve.rules.validate import GenerationPlan


def _to_device(layout: PackedLayout, device: torch.device) -> PackedLayout:
    return PackedLayout(
        token_tags=layout.token_tags.to(device),
        position_ids=layout.position_ids.to(device),
        video_indices=layout.video_indices.to(device),
        audio_indices=layout.audio_indices.to(device),
        text_indices=layout.text_indices.to(device),
    )


class H3Pipeline(ContinuationMixin):
    """Runs T2VA, FL2VA and Ref2VA requests on loaded components. Stateless between requests."""

    def __init__(
        self,
        components: H3Components,
        device: str | torch.device = "cpu",
        hooks: StageHooks | None = None,
        cache: BlockCache | None = None,  # the DiT block cache (h3serve.accel.cache); None: every block runs
        adaln: AdaLNMemo | None = None,  # AdaLN modulations computed ahead and memoised; None: in each forward
    ):
        self.components = components
        self.device = torch.device(device)
        self.hooks = hooks or NoHooks()
        self.cache = cache
        self.adaln = adaln
        self.decoder = Decoder(components, self.device)

    @torch.no_grad()
    def generate(
        self,
        plan: GenerationPlan,
        conditioning: Conditioning | None = None,
        on_step: StepCallback | None = None,
        sink: FrameSink | None = None,
    ) -> GenerationResult:
        """Run one plan. With a `sink` the video is streamed into it clip by clip (the result holds no frames);
        without one it is decoded whole into `result.video`."""
        with self.hooks.request(plan.task):
            if plan.continuation:
                return self._generate_continuation(plan, conditioning or Conditioning(), on_step, sink)
            return self._generate(plan, conditioning or Conditioning(), on_step, sink)

    def _generate(
        self, plan: GenerationPlan, cond: Conditioning, on_step: StepCallback | None, sink: FrameSink | None = None
    ) -> GenerationResult:
        clock = StageClock(self.device, self.hooks)
        enc = self.encode(plan, cond, clock)
        dit = self.components.transformer_ref if cond.references else self.components.transformer
        target = Target.of(plan)
        edits = self.encode_edit(plan, cond, clock) if plan.edit else (None, None)
        forwards = len(self._schedules(plan)[0])
        cached = self.cache is not None and dit is not None
        with self.cache.for_request(dit, plan.quality, forwards) if cached else nullcontext() as cache:
            video_latents, audio_latents = self._sample(plan, enc, dit, target, plan.seed, clock, on_step, edits)
        return self._decode(video_latents, audio_latents, clock, cache, sink)

    def encode_edit(
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
                clean = self.encode_source_frames(cond.edit_video)
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

    def encode_source_frames(self, frames: np.ndarray) -> torch.Tensor:
        """Decoded source frames [T, H, W, 3] uint8 -> normalised latents [1, 24, F, lh, lw] (the condition recipe)."""
        pixels = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].to(self.device)
        return encode_visual_condition(self.components.vae, pixels)

    def padded_audio_latents(self, waveform: torch.Tensor, length: int) -> tuple[torch.Tensor, int]:
        """A source waveform [2, N] -> normalised latents [2, length, 32], cropped or zero-padded, and how many of
        them the source covers."""
        rows = encode_audio_condition(self.components.audio_vae, waveform)
        source = rows.reshape(limits.AUDIO_CHANNELS, -1, rows.shape[-1])[:, :length]
        clean = torch.zeros(limits.AUDIO_CHANNELS, length, rows.shape[-1])
        clean[:, : source.shape[1]] = source
        return clean, source.shape[1]

    def _initial_rows(
        self, enc: Encoded, target: Target, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(video rows, audio rows) at the first step, conditions noised, and the target's (video, audio) noise."""
        # One CPU generator, the reference's draw order: condition noise, then video noise, then audio noise.
        # Conditions may arrive on the host (VAE encodes) or on the device (a continuation window's guide is the
        # previous window's output): each is mixed with its noise on the device, never across devices.
        generator = torch.Generator("cpu").manual_seed(seed)
        condition_rows = [
            patchify(
                scale_noise(
                    z.to(self.device),
                    limits.KEYFRAME_NOISE_AUG_T,
                    torch.randn(z.shape, generator=generator).to(self.device),
                )
            )
            for z in enc.visual
        ]
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

    def _sample(
        self,
        plan: GenerationPlan,
        enc: Encoded,
        dit: H3Transformer | None,
        target: Target,
        seed: int,
        clock: StageClock,
        on_step: StepCallback | None,
        edits: tuple[MaskedTarget | None, MaskedTarget | None] = (None, None),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw the noise, denoise, and return the target latents: video [1, 24, F, lh, lw], audio [2, 32, A]."""
        video_rows, audio_rows, video_noise, audio_noise = self._initial_rows(enc, target, seed)
        channels = self.components.vae.config.latent_channels
        for edit, noise in zip(edits, (patchify(video_noise), audio_noise), strict=True):
            if edit is not None:
                edit.set_anchor(noise)
        if video_rows.shape[0] != enc.layout.packed.video_indices.numel():
            raise ValueError("condition latents do not match the layout (canvas mismatch)")
        if dit is None:
            raise ValueError(f"the {plan.task} DiT is not loaded")
        schedules = self._schedules(plan)
        with clock("denoise"):
            video_rows, audio_rows = self.denoise(
                schedules, dit, enc.layout, enc.text_states, video_rows, audio_rows, on_step, edits,
                solver=plan.sample_solver,
            )
        clock.steps += len(schedules[0])
        layout = enc.layout
        video_latents = unpatchify(
            video_rows[layout.num_video_condition_rows :],
            channels,
            target.latent_frames,
            target.latent_height,
            target.latent_width,
        )
        audio_latents = (
            audio_rows[layout.num_audio_reference_rows :]
            .reshape(limits.AUDIO_CHANNELS, target.audio_latents, -1)
            .permute(0, 2, 1)
            .contiguous()
        )
        return video_latents, audio_latents

    def _decode(
        self,
        video_latents: torch.Tensor,
        audio_latents: torch.Tensor,
        clock: StageClock,
        cache: CacheStats | None,
        sink: FrameSink | None = None,
        head: SourceHead | None = None,
    ) -> GenerationResult:
        clock.durations["denoise_per_step"] = clock.durations["denoise"] / max(1, clock.steps)
        return self.decoder.decode(video_latents, audio_latents, clock, cache, sink, head)

    # -- conditioning ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, plan: GenerationPlan, cond: Conditioning, clock: StageClock | None = None) -> Encoded:
        """Presentation -> text states, condition latents and the packed layout."""
        clock = clock or StageClock(self.device, self.hooks)
        if cond.references:
            media = self.encode_reference_media(cond.references, clock)
            target = Target.of(plan)
            return reference_encoded(self.components, media, self._presentation(media, plan.prompt), target, clock)
        return keyframes_encoded(self.components, self.device, plan, cond.keyframes, cond.anchors, clock)

    def encode_reference_media(self, refs: list[Reference], clock: StageClock) -> ReferenceMedia:
        return reference_media(self.components, self.device, refs, clock)

    def _presentation(self, media: ReferenceMedia, prompt: str) -> Presentation:
        return presentation(self.components, media, prompt)

    # -- sampling and decoding -------------------------------------------------------------------------------

    def _schedules(self, plan: GenerationPlan) -> tuple[FlowSchedule, FlowSchedule]:
        video = FlowSchedule.shifted(plan.steps, plan.flow_shift, plan.pinned_positions)
        audio = FlowSchedule.shifted(plan.steps, plan.audio_flow_shift, plan.pinned_positions)
        if len(video) != len(audio):
            raise ValueError(
                f"video and audio schedules differ in length ({len(video)} vs {len(audio)}) for steps={plan.steps}"
            )
        return video, audio

    def denoise(
        self,
        schedules: tuple[FlowSchedule, FlowSchedule],  # (video, audio), equal lengths
        transformer: H3Transformer,
        layout: Layout,
        text_states: torch.Tensor,
        video_rows: torch.Tensor,  # [Nv, C·4] fp32, condition rows first
        audio_rows: torch.Tensor,  # [Na, 32] fp32, reference rows first
        on_step: StepCallback | None = None,
        edits: tuple[MaskedTarget | None, MaskedTarget | None] = (None, None),  # (video, audio) latent-mask edits
        solver: str = DEFAULT_SAMPLE_SOLVER,  # names.SAMPLE_SOLVERS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling loop. Only target rows are stepped; condition rows stay as given. Each modality has its
        own solver state on its own schedule.

        Everything a step reads that is not a latent (timesteps, row indices, sigmas, solver weights) moves to
        the device once, before the loop: a step issues no host -> device copy and no synchronisation."""
        times = step_times(schedules, layout, edits, self.device)
        video_solver, audio_solver = (FlowSolver(s, solver, self.device) for s in schedules)
        packed = _to_device(layout.packed, self.device)
        text = transformer.embed_text(text_states.to(self.device))  # once per request, not per step
        nv, na = layout.num_video_condition_rows, layout.num_audio_reference_rows
        video_edit, audio_edit = [None if e is None else e.to(self.device) for e in edits]
        total = len(times)
        modulations = self._modulations(transformer, times, layout)
        for i in range(total):
            video_in, audio_in = video_rows, audio_rows
            if video_edit is not None:  # latent-mask editing: the model reads the anchored blend
                video_in = torch.cat([video_rows[:nv], video_edit.model_input(video_rows[nv:])])
            if audio_edit is not None:
                audio_in = torch.cat([audio_rows[:na], audio_edit.model_input(audio_rows[na:])])
            step_mod = None if modulations is None else modulations[i]
            v_vel, a_vel = transformer(
                video_in[None], audio_in[None], text, times.timesteps[i], times.row_index[i], packed, step_mod
            )
            for step, rows, model_in, vel, n, edit in (
                (video_solver, video_rows, video_in, v_vel, nv, video_edit),
                (audio_solver, audio_rows, audio_in, a_vel, na, audio_edit),
            ):
                if edit is None:
                    rows[n:] = step.step(vel[0, n:], i, rows[n:])
                else:  # the step starts from the un-blended state, towards the restored clean estimate
                    t = step.schedule.timesteps[i].to(rows.device, rows.dtype)
                    rows[n:] = step.step_from_x0(edit.clean_estimate(model_in[n:], vel[0, n:], t), i, rows[n:])
            if on_step is not None:
                on_step(i + 1, total)
        return video_rows, audio_rows

    def _modulations(self, transformer: H3Transformer, times: StepTimes, layout: Layout):
        """The request's AdaLN modulations, one per step (None when memoisation is off)."""
        if self.adaln is None:
            return None
        steps = [ForwardTimes(times.timesteps[i], times.row_index[i]) for i in range(len(times))]
        name = "transformer_ref" if transformer is self.components.transformer_ref else "transformer"
        tags = layout.packed.token_tags
        return self.adaln.prepare(name, transformer, steps, tags, self.device, self.hooks.weights)
