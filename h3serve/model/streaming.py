"""The pipeline's streamed decode (`--decode-mode stream`): soundtrack first, then the video clip by clip.

The full decode holds the whole float32 video several times (decoder output, post-processed copy, host copy);
here one VAE clip at a time becomes uint8 on the device and goes to the `FrameSink` (the MP4 writer) at once,
so the decode's working set is one clip, whatever the video's length. Frames and rounding are those of the full
decode followed by `write_mp4` (h3serve.model.stream_decode), so the MP4 bytes are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from h3serve import limits
from h3serve.model.pipeline_types import CacheStats, FrameSink, GenerationResult, StageClock
from h3serve.model.stream_decode import decode_chunks, decoded_frames, rgb8

if TYPE_CHECKING:
    from h3serve.model.pipeline import H3Pipeline


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


def stream_decode(
    pipe: H3Pipeline,
    video_latents: torch.Tensor,
    audio_latents: torch.Tensor,
    clock: StageClock,
    cache: CacheStats | None,
    sink: FrameSink,
    head: SourceHead | None = None,
) -> GenerationResult:
    """Decode the soundtrack, open `sink` with it, then feed it the video's uint8 frames clip by clip."""
    with clock("audio_decode"):
        audio = pipe.decode_audio(audio_latents).cpu()
    if head is not None:
        head.overlay_audio(audio)
    vae = pipe.components.vae
    ratio = vae.spatial_compression_ratio
    num_frames = decoded_frames(vae, video_latents.shape[2])
    height, width = video_latents.shape[-2] * ratio, video_latents.shape[-1] * ratio
    with clock("video_decode"), sink.open(num_frames, height, width, audio.numpy()) as writer:
        done = 0
        for piece in decode_chunks(vae, pipe.denormalised_video(video_latents)):
            frames = rgb8(piece, done).cpu().numpy()
            if head is not None and done < head.video.shape[0]:
                # The full path writes source / 255 here; the MP4 rounding gives the source's own bytes back.
                given = head.video[done : done + frames.shape[0]]
                frames[: given.shape[0]] = given
            writer.write(frames)
            done += frames.shape[0]
            del piece, frames  # a view of the clip: dropped, so the clip is freed before the next one decodes
    return GenerationResult.decoded(None, audio, (video_latents, audio_latents), clock.durations, cache, num_frames)
