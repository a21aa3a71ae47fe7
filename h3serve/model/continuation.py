"""Long video by continuation (windows planned in `h3serve.rules.long_video`), a part `H3Pipeline` owns.

Each window is a Ref2VA pass over its own frames; the previous window's last overlap latents ride along as a
latent guide on the RoPE positions of the window's first latents. A latent-mask edit (masks on the whole video's
latent grid) gives each window its slice of the source and the masks. Windows are stitched with a hard latent cut
and decoded once. An extension's window 0 is the given video, VAE-encoded instead of generated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3serve.model.conditioning import Presentation
from h3serve.model.decoder import Decoder, SourceHead
from h3serve.model.encode_inputs import reference_encoded
from h3serve.model.latent_edit import MaskedTarget, audio_target, video_target
from h3serve.model.layout import ReferenceBlock
from h3serve.model.pipeline_types import (
    Conditioning,
    FrameSink,
    GenerationResult,
    LatentGuide,
    LatentTarget,
    ReferenceMedia,
    StageClock,
    StepCallback,
)
from h3serve.model.request_encoder import RequestEncoder
from h3serve.model.sampler import Sampler
from h3serve.rules import limits
from h3serve.rules.long_video import Window, window_seed
from h3serve.rules.validate import GenerationPlan


@dataclass
class EditSource:
    """A continuation's latent-mask edit, prepared once for all windows."""

    video_mask: torch.Tensor | None = None  # [T, H, W] on the whole video's latent grid
    audio: torch.Tensor | None = None  # [2, A, 32] source audio latents on the global timeline
    audio_covered: int = 0  # how many of them the source covers (the rest is padding)
    audio_mask: torch.Tensor | None = None  # [2, A]


class Continuation:
    """Runs a continuation plan's windows with the pipeline's own encoder, sampler and decoder."""

    def __init__(self, encoder: RequestEncoder, sampler: Sampler, decoder: Decoder):
        self.encoder = encoder
        self.sampler = sampler
        self.decoder = decoder
        self.components = encoder.components
        self.device = encoder.device

    def generate(
        self,
        plan: GenerationPlan,
        cond: Conditioning,
        clock: StageClock,
        on_step: StepCallback | None,
        sink: FrameSink | None = None,
    ) -> GenerationResult:
        """Windows in order, each a Ref2VA pass over its own frames with the previous window's last overlap
        latents carried as a latent guide; latents stitched with a hard cut, decoded once at the end.

        Progress counts every step of every window (one bar, 0 -> 100); `on_step` is also called between windows
        (same count), so a cancellation lands between windows as well as within them. Uncached denoising.
        """
        media = self.encoder.reference_media(cond.references, clock)
        edit_source = self._edit_source(plan, cond, clock)
        texts = [self.encoder.presentation(media, prompt) for prompt in plan.window_prompts]
        media_origin = float(max(len(text.ids) for text in texts))  # one media clock for every window
        per_window = len(self.sampler.schedules(plan)[0])
        extending = plan.extend_video is not None  # window 0 is the given video, encoded, not generated
        total = per_window * (len(plan.windows) - extending)
        kept_video: list[torch.Tensor] = []
        kept_audio: list[torch.Tensor] = []
        guide: LatentGuide | None = None
        for window in plan.windows:
            done = (window.index - extending) * per_window
            if on_step is not None and window.index > extending:
                on_step(done, total)

            def progress(i: int, _n: int, done: int = done) -> None:
                if on_step is not None:
                    on_step(done + i, total)

            if extending and window.index == 0:
                video, audio = self.extension_source(plan, cond, window, clock)
            else:
                offset = sum(v.shape[2] for v in kept_video) - window.overlap_latent_frames
                edits = self.window_edits(plan, cond, window, offset, edit_source, clock)
                video, audio = self.run_window(
                    plan, window, media, texts[window.index], media_origin, guide, clock, progress, edits
                )
            kept_video.append(video[:, :, window.overlap_latent_frames :])
            kept_audio.append(audio[:, :, window.overlap_audio_latents :])
            if window.index + 1 < len(plan.windows):
                following = plan.windows[window.index + 1]
                guide = LatentGuide(
                    video[:, :, video.shape[2] - following.overlap_latent_frames :],
                    audio[:, :, audio.shape[2] - following.overlap_audio_latents :],
                )
        video_latents, audio_latents = torch.cat(kept_video, dim=2), torch.cat(kept_audio, dim=2)
        if (video_latents.shape[2], audio_latents.shape[2]) != (plan.latent_frames, plan.audio_latents):
            raise RuntimeError("continuation produced inconsistent cumulative AV lengths")
        clock.record_denoise_per_step()
        if sink is not None:  # streamed: the source frames and soundtrack go in as the chunks pass
            head = SourceHead(cond.extend_video, cond.extend_audio) if extending else None
            return self.decoder.decode(video_latents, audio_latents, clock, None, sink, head)
        result = self.decoder.decode(video_latents, audio_latents, clock, None)
        if extending:  # the output starts with the source itself (on the canvas), not its VAE round trip
            source = torch.from_numpy(cond.extend_video).float() / 255.0
            result.video[: source.shape[0]] = source
            if cond.extend_audio is not None:
                n = min(cond.extend_audio.shape[1], round(source.shape[0] * limits.AUDIO_SAMPLE_RATE / limits.FPS))
                result.audio[:, :n] = cond.extend_audio[:, :n]
        return result

    def _edit_source(self, plan: GenerationPlan, cond: Conditioning, clock: StageClock) -> EditSource:
        """The request's masks as arrays and its source audio latents on the global timeline (encoded once);
        each window's source video frames are encoded in `window_edits`."""
        source = EditSource()
        if plan.video_mask is not None:
            if cond.edit_video is None:
                raise ValueError("a video mask needs the decoded source video")
            source.video_mask = torch.from_numpy(plan.video_mask.array())
        if plan.audio_mask is not None:  # an audio edit, or lock_source's driving audio (an all-0 mask)
            with clock("vae_encode"):
                source.audio, source.audio_covered = self.encoder.source_audio_latents(plan, cond)
            source.audio_mask = torch.from_numpy(plan.audio_mask.array())
        return source

    def window_edits(
        self,
        plan: GenerationPlan,
        cond: Conditioning,
        window: Window,
        latent_offset: int,
        source: EditSource,
        clock: StageClock,
    ) -> tuple[MaskedTarget | None, MaskedTarget | None]:
        """One window's slice of the request's latent-mask edit: its frames of the source video, VAE-encoded, and
        the masks' latent frames [latent_offset, + its latent frames) (its first ones are the previous window's
        last, where the windows overlap); the audio latents [audio_start, audio_end) of the global timeline. A
        padded audio tail is generated, except under lock_source (held whole, as in a single pass)."""
        video = audio = None
        if source.video_mask is not None and cond.edit_video is not None:
            with clock("vae_encode"):
                clean = self.encoder.source_frames(cond.edit_video[window.start : window.end])
            video = video_target(clean, source.video_mask[latent_offset : latent_offset + window.latent_frames])
        if source.audio is not None and source.audio_mask is not None:
            held = source.audio[:, window.audio_start : window.audio_end]
            grid = source.audio_mask[:, window.audio_start : window.audio_end].clone()
            if plan.audio_mode != "lock_source":
                grid[:, max(0, source.audio_covered - window.audio_start) :] = 1.0
            audio = audio_target(held.reshape(-1, held.shape[-1]), grid)
        return video, audio

    def extension_source(
        self, plan: GenerationPlan, cond: Conditioning, window: Window, clock: StageClock
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An extension's window 0 on the compute device: the source video's latents [1, 24, F, lh, lw] and its
        soundtrack's [2, 32, A] (cropped or zero-padded to the window; zeros without a soundtrack)."""
        if cond.extend_video is None or cond.extend_video.shape[0] != window.num_frames:
            raise ValueError("an extension needs its source frames (window 0) decoded")
        with clock("vae_encode"):
            video = self.encoder.source_frames(cond.extend_video)
            if cond.extend_audio is None:
                channels = self.components.audio_vae.config.latent_channels
                audio = torch.zeros(limits.AUDIO_CHANNELS, channels, window.audio_latents)
            else:
                audio = self.encoder.padded_audio_latents(cond.extend_audio, window.audio_latents)[0].permute(0, 2, 1)
        # On the compute device, as every generated window's latents: they are stitched and carried together.
        return video.to(self.device), audio.contiguous().to(self.device)

    def run_window(
        self,
        plan: GenerationPlan,
        window: Window,
        media: ReferenceMedia,
        text: Presentation,
        media_origin: float,
        guide: LatentGuide | None,
        clock: StageClock,
        on_step: StepCallback | None,
        edits: tuple[MaskedTarget | None, MaskedTarget | None] = (None, None),  # this window's (window_edits)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One continuation window -> its latents (video [1, 24, F, lh, lw], audio [2, 32, A]).

        The guide rows are the clean latents, noise-augmented like every visual condition; they sit on the RoPE
        positions of this window's first latents. The window's noise comes from `window_seed(seed, index)`."""
        target = LatentTarget(window.latent_frames, plan.latent_height, plan.latent_width, window.audio_latents)
        extra = None
        if guide is not None:
            _, _, frames, h, w = guide.video.shape
            extra = (ReferenceBlock("latent_guide", frames, h, w, guide.audio.shape[2]), guide)
        enc = reference_encoded(
            self.components, media, text, target, clock, extra, media_origin, window.temporal_offset
        )
        seed = window_seed(plan.seed, window.index)
        return self.sampler.sample(plan, enc, self.components.transformer_ref, target, seed, clock, on_step, edits)
