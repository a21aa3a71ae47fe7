"""The pipeline's last stage: normalised latents -> frames and a stereo waveform, decoded whole or streamed.

Both decode the soundtrack first. The whole decode returns float32 frames in [0, 1]. The streamed decode
(`--decode-mode stream`) then decodes the video one VAE clip at a time, each clip turned into uint8 on the device and
handed to the `FrameSink` (the MP4 writer, which encodes it on its own thread while the next clip decodes: the
`mux` stage's span overlaps `video_decode`'s), so its working set is one clip, whatever the video's length; its
frames and rounding are the whole decode's followed by `write_mp4` (h3serve.model.stream_decode), so the MP4 bytes
are equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from h3serve.model.audio_windows import decode_windows
from h3serve.model.pipeline_types import CacheStats, FrameSink, GenerationResult, H3Components, StageClock
from h3serve.model.stream_decode import decode_chunks, decoded_frames, rgb8
from h3serve.rules import limits


@dataclass(frozen=True)
class SourceHead:
    """An extension's given video at the start of the output, in place of its VAE round trip."""

    video: np.ndarray  # uint8 [S, H, W, 3] on the canvas
    audio: torch.Tensor | None  # its soundtrack [2, N] at 32 kHz, if it has one

    def overlay_audio(self, audio: torch.Tensor) -> None:
        """The source's soundtrack over the output's first S frames' worth of samples (in place)."""
        if self.audio is not None:
            n = min(self.audio.shape[1], round(self.video.shape[0] * limits.AUDIO_SAMPLE_RATE / limits.FPS))
            audio[:, :n] = self.audio[:, :n]


class Decoder:
    """Decodes with the components' two VAEs on `device`."""

    def __init__(self, components: H3Components, device: torch.device):
        self.components = components
        self.device = device

    def decode(
        self,
        video_latents: torch.Tensor,
        audio_latents: torch.Tensor,
        clock: StageClock,
        cache: CacheStats | None,
        sink: FrameSink | None = None,
        head: SourceHead | None = None,
    ) -> GenerationResult:
        """Both modalities: into `sink` clip by clip when one is given (the result holds no frames), else whole."""
        if sink is not None:
            return self._stream(video_latents, audio_latents, clock, cache, sink, head)
        # Decoded outputs leave the device at once: the next stage's (or request's) weights need the room. The
        # soundtrack first, as the streamed decode does (its writer needs it before the first frame).
        with clock("audio_decode"):
            audio = self.decode_audio(audio_latents).cpu()
        with clock("video_decode"):
            video = self.decode_video(video_latents).cpu()
        return GenerationResult.decoded(video, audio, (video_latents, audio_latents), clock, cache, video.shape[0])

    def denormalised_video(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> the VAE decoder's input, on the device and in its dtype."""
        vae = self.components.vae
        mean = torch.tensor(vae.config.latents_mean, device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=self.device).view(1, -1, 1, 1, 1)
        return (latents.to(self.device) * std + mean).to(vae.post_quant_conv.weight.dtype)

    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [1, 24, F, lh, lw] -> frames [T, H, W, 3] fp32 in [0, 1] (tiled, chunked VAE)."""
        x = self.components.vae.decode(self.denormalised_video(latents), return_dict=False)[0]  # [1, 3, T, H, W]
        pix_mean = torch.tensor(limits.PIXEL_MEAN, device=self.device).view(1, -1, 1, 1, 1)
        pix_std = torch.tensor(limits.PIXEL_STD, device=self.device).view(1, -1, 1, 1, 1)
        # In place on the decoder's own output (a copy only if the VAE ran in bf16): the same values as
        # `(x * std + mean).clamp(0, 1)` without two more frame-sized temporaries at the request's memory peak.
        x = x.float().mul_(pix_std).add_(pix_mean).clamp_(0, 1)
        return x[0].permute(1, 2, 3, 0).contiguous()

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [2, 32, A] -> stereo waveform [2, 800·A] fp32 in [-1, 1], decoded in bounded latent
        windows (h3serve.model.audio_windows) in both decode modes."""
        avae = self.components.audio_vae
        mean = torch.tensor(avae.config.latents_mean, device=self.device).view(1, -1, 1)
        std = torch.tensor(avae.config.latents_std, device=self.device).view(1, -1, 1)
        wave = decode_windows(avae, latents.to(self.device) * std + mean)  # [2, 1, N]
        return wave.float()[:, 0]

    def _stream(
        self,
        video_latents: torch.Tensor,
        audio_latents: torch.Tensor,
        clock: StageClock,
        cache: CacheStats | None,
        sink: FrameSink,
        head: SourceHead | None,
    ) -> GenerationResult:
        """Decode the soundtrack, open `sink` with it, then feed it the video's uint8 frames clip by clip (host
        arrays, or device tensors for a writer that reads the device); the writer's encode is the `mux` span."""
        with clock("audio_decode"):
            audio = self.decode_audio(audio_latents).cpu()
        if head is not None:
            head.overlay_audio(audio)
        vae = self.components.vae
        ratio = vae.spatial_compression_ratio
        num_frames = decoded_frames(vae, video_latents.shape[2])
        height, width = video_latents.shape[-2] * ratio, video_latents.shape[-1] * ratio
        with sink.open(num_frames, height, width, audio.numpy()) as writer, clock("video_decode"):
            done = 0
            for piece in decode_chunks(vae, self.denormalised_video(video_latents)):
                frames = rgb8(piece, done)
                if head is not None and done < head.video.shape[0]:
                    # The full path writes source / 255 here; the MP4 rounding gives the source's own bytes back.
                    given = torch.from_numpy(head.video[done : done + frames.shape[0]])
                    frames[: given.shape[0]] = given.to(frames.device)
                count = frames.shape[0]
                writer.write(frames if writer.on_device else frames.cpu().numpy())
                done += count
                del piece, frames  # a view of the clip: dropped, so the clip is freed before the next one decodes
        if writer.span is not None:
            clock.span("mux", *writer.span)
        return GenerationResult.decoded(None, audio, (video_latents, audio_latents), clock, cache, num_frames)
