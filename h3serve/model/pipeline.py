"""The H3 generation pipeline: encode text -> lay out rows -> denoise -> decode video and audio.

One `GenerationPlan` in, one `GenerationResult` out. The components are plain torch modules; loading
them is `h3serve.checkpoint`'s job. Noise is drawn from one CPU generator in the reference's order
(condition noise, video noise, audio noise), so a seed reproduces the reference pipeline's output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from h3serve import limits
from h3serve.model.layout import TEXT_TAG, Layout, build_keyframe_layout, patchify, unpatchify
from h3serve.model.scheduler import FlowSchedule
from h3serve.model.text_encoder import TextConditioner
from h3serve.model.transformer import H3Transformer, PackedLayout
from h3serve.validate import GenerationPlan

StepCallback = Callable[[int, int], None]  # (steps done, total); may raise to abort the request


@dataclass
class H3Components:
    """Everything one pipeline needs, already on its device."""

    transformer: H3Transformer
    vae: nn.Module  # AutoencoderKLMiniMaxH3
    audio_vae: nn.Module  # AutoencoderKLMiniMaxH3Audio
    text: TextConditioner


@dataclass
class GenerationResult:
    video: torch.Tensor  # [T, H, W, 3] float32 in [0, 1]
    audio: torch.Tensor  # [2, N] float32 in [-1, 1] at 32 kHz
    video_latents: torch.Tensor  # [1, 24, F, lh, lw] normalised latents, fp32
    audio_latents: torch.Tensor  # [2, 32, A] normalised latents, fp32
    stage_durations: dict[str, float] = field(default_factory=dict)


class _StageClock:
    """Accumulates wall time per named stage (synchronising the GPU so the figures are real)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.durations: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.durations[name] = self.durations.get(name, 0.0) + time.perf_counter() - start


def _to_device(layout: PackedLayout, device: torch.device) -> PackedLayout:
    return PackedLayout(
        token_tags=layout.token_tags.to(device),
        position_ids=layout.position_ids.to(device),
        video_indices=layout.video_indices.to(device),
        audio_indices=layout.audio_indices.to(device),
        text_indices=layout.text_indices.to(device),
    )


class H3Pipeline:
    """Runs T2VA requests on loaded components. Stateless between requests."""

    def __init__(self, components: H3Components, device: str | torch.device = "cpu"):
        self.c = components
        self.device = torch.device(device)

    @torch.no_grad()
    def generate(self, plan: GenerationPlan, on_step: StepCallback | None = None) -> GenerationResult:
        clock = _StageClock(self.device)
        with clock("text_encode"):
            ids = self.c.text.tokenize(plan.prompt)
            text_states = self.c.text.encode(ids)  # [1, L, text_dim]
            text_tags = torch.full((len(ids),), TEXT_TAG, dtype=torch.long)

        layout = build_keyframe_layout(
            text_tags, plan.latent_frames, plan.latent_height, plan.latent_width, plan.audio_latents
        )
        generator = torch.Generator("cpu").manual_seed(plan.seed)
        video_noise = torch.randn(
            (1, self.c.vae.config.latent_channels, plan.latent_frames, plan.latent_height, plan.latent_width),
            generator=generator,
            dtype=torch.float32,
        )
        audio_noise = torch.randn(
            (limits.AUDIO_CHANNELS * plan.audio_latents, self.c.audio_vae.config.latent_channels),
            generator=generator,
            dtype=torch.float32,
        )
        video_rows = patchify(video_noise).to(self.device)
        audio_rows = audio_noise.to(self.device)

        with clock("denoise"):
            video_rows, audio_rows = self.denoise(plan, layout, text_states, video_rows, audio_rows, on_step)
        clock.durations["denoise_per_step"] = clock.durations["denoise"] / max(1, len(self._schedules(plan)[0]))

        video_latents = unpatchify(
            video_rows[layout.num_video_condition_rows :],
            self.c.vae.config.latent_channels,
            plan.latent_frames,
            plan.latent_height,
            plan.latent_width,
        )
        audio_latents = (
            audio_rows[layout.num_audio_reference_rows :]
            .reshape(limits.AUDIO_CHANNELS, plan.audio_latents, -1)
            .permute(0, 2, 1)
            .contiguous()
        )
        with clock("video_decode"):
            video = self.decode_video(video_latents)
        with clock("audio_decode"):
            audio = self.decode_audio(audio_latents)
        return GenerationResult(
            video=video.cpu(),
            audio=audio.cpu(),
            video_latents=video_latents.cpu(),
            audio_latents=audio_latents.cpu(),
            stage_durations=clock.durations,
        )

    def _schedules(self, plan: GenerationPlan) -> tuple[FlowSchedule, FlowSchedule]:
        video = FlowSchedule.shifted(plan.steps, plan.flow_shift)
        audio = FlowSchedule.shifted(plan.steps, plan.audio_flow_shift)
        if len(video) != len(audio):
            raise ValueError(
                f"video and audio schedules differ in length ({len(video)} vs {len(audio)}) for steps={plan.steps}"
            )
        return video, audio

    def denoise(
        self,
        plan: GenerationPlan,
        layout: Layout,
        text_states: torch.Tensor,
        video_rows: torch.Tensor,  # [Nv, C·4] fp32, condition rows first
        audio_rows: torch.Tensor,  # [Na, 32] fp32, reference rows first
        on_step: StepCallback | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling loop. Only target rows are stepped; condition rows stay as given."""
        transformer = self.c.transformer
        video_sched, audio_sched = self._schedules(plan)
        packed = _to_device(layout.packed, self.device)
        text = transformer.embed_text(text_states.to(self.device))  # once per request, not per step
        nv, na = layout.num_video_condition_rows, layout.num_audio_reference_rows
        total = len(video_sched)
        for i in range(total):
            timestep, row_index = layout.row_timesteps(
                float(video_sched.timesteps[i]), float(audio_sched.timesteps[i]), limits.KEYFRAME_NOISE_AUG_T
            )
            v_vel, a_vel = transformer(
                video_rows[None], audio_rows[None], text, timestep.to(self.device), row_index.to(self.device), packed
            )
            video_rows[nv:] = video_sched.step(v_vel[0, nv:], i, video_rows[nv:])
            audio_rows[na:] = audio_sched.step(a_vel[0, na:], i, audio_rows[na:])
            if on_step is not None:
                on_step(i + 1, total)
        return video_rows, audio_rows

    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [1, 24, F, lh, lw] -> frames [T, H, W, 3] fp32 in [0, 1] (tiled, chunked VAE)."""
        vae = self.c.vae
        mean = torch.tensor(vae.config.latents_mean, device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=self.device).view(1, -1, 1, 1, 1)
        z = latents.to(self.device) * std + mean
        x = vae.decode(z.to(vae.post_quant_conv.weight.dtype), return_dict=False)[0]  # [1, 3, T, H, W]
        pix_mean = torch.tensor(limits.PIXEL_MEAN, device=self.device).view(1, -1, 1, 1, 1)
        pix_std = torch.tensor(limits.PIXEL_STD, device=self.device).view(1, -1, 1, 1, 1)
        x = (x.float() * pix_std + pix_mean).clamp(0, 1)
        return x[0].permute(1, 2, 3, 0).contiguous()

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [2, 32, A] -> stereo waveform [2, 800·A] fp32 in [-1, 1]."""
        avae = self.c.audio_vae
        mean = torch.tensor(avae.config.latents_mean, device=self.device).view(1, -1, 1)
        std = torch.tensor(avae.config.latents_std, device=self.device).view(1, -1, 1)
        wave = avae.decode(latents.to(self.device) * std + mean, return_dict=False)[0]  # [2, 1, N]
        return wave.float()[:, 0]
