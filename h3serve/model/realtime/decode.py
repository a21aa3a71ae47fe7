"""A real-time chunk's media: its clean latents decoded as they come, frames and the matching audio.

Video: the VAE decodes the timeline in windows of 7 latents every 5 (window i reads latents [5i, 5i + 7)); each
keeps its frames [3, 20) as 17 new frames, the first 5 cross-faded with the previous window's frames [23, 28).
After a chunk every window its latents complete is decoded, exactly as the whole-timeline decode would
(`h3serve.model.stream_decode.decode_chunks`); the newest window's 5-frame tail waits for the next chunk, or for
`flush` at the end of the session. Audio: the base model's clean latents of a whole request are known when the
request starts; a chunk's samples (aligned to its frames at 32 kHz) are decoded from the latents around them, with
the decoder's reach (`audio_windows.halo_latents`) on each side where it has them.
"""

from __future__ import annotations

import torch

from h3serve.model.audio_windows import halo_latents
from h3serve.model.decoder import Decoder
from h3serve.model.stream_decode import rgb8
from h3serve.model.tile_stitch import decode_clip
from h3serve.rules import limits
from h3serve.rules.realtime_geometry import OVERLAP_FRAMES, WINDOW_FRAMES, WINDOW_LATENTS, WINDOW_STEP

HOP = limits.AUDIO_SAMPLE_RATE // limits.AUDIO_LATENTS_PER_SECOND  # 800 samples per audio latent


class ChunkVideoDecoder:
    """The video VAE's windows, decoded as a chunk's latents complete them."""

    def __init__(self, decoder: Decoder):
        vae = decoder.components.vae
        geometry = (vae.tokens_chunk_size, vae.token_overlap, vae.frame_pre_padding, vae.frame_overlap)
        if geometry != (WINDOW_STEP, WINDOW_LATENTS - WINDOW_STEP, 3, OVERLAP_FRAMES) or not vae.config.token_drop:
            raise ValueError(f"the video VAE's temporal windows {geometry} are not H3's (5, 2, 3, 5)")
        self.decoder, self.vae = decoder, vae
        self.clip = vae.__dict__.get("_decode_clip") or (lambda z: decode_clip(vae, z))  # VAE tiles: rank 0 gets it
        self.latents: torch.Tensor | None = None  # de-normalised, from global latent `base`
        self.base = self.total = self.window = self.emitted = 0
        self.overlap: torch.Tensor | None = None

    def push(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [1, 24, n, lh, lw] -> the frames they complete, uint8 [t, H, W, 3] on the device
        (none on a rank that does not receive the VAE's tiles)."""
        z = self.decoder.denormalised_video(latents)
        self.latents = z if self.latents is None else torch.cat([self.latents, z], dim=2)
        self.total += z.shape[2]
        pieces = []
        while WINDOW_STEP * self.window + WINDOW_LATENTS <= self.total:
            start = WINDOW_STEP * self.window - self.base
            clip = self.clip(self.latents[:, :, start : start + WINDOW_LATENTS])
            self.window += 1
            if clip is None:
                continue
            piece = clip[:, :, 3 : 3 + WINDOW_FRAMES].clone()
            if self.overlap is not None:
                piece[:, :, :OVERLAP_FRAMES] = self.vae._blend(self.overlap, piece[:, :, :OVERLAP_FRAMES],
                                                               OVERLAP_FRAMES, dim=-3)
            self.overlap = clip[:, :, -OVERLAP_FRAMES:].clone()
            pieces.append(rgb8(piece, self.emitted))
            self.emitted += WINDOW_FRAMES
        keep = WINDOW_STEP * self.window
        if keep > self.base:
            self.latents = self.latents[:, :, keep - self.base :]
            self.base = keep
        return torch.cat(pieces) if pieces else self._none()

    def flush(self) -> torch.Tensor:
        """The last window's 5-frame tail (the end of the session)."""
        if self.overlap is None:
            return self._none()
        frames, self.overlap = rgb8(self.overlap, self.emitted), None
        self.emitted += OVERLAP_FRAMES
        return frames

    def _none(self) -> torch.Tensor:
        return torch.zeros((0, 0, 0, 3), dtype=torch.uint8)


class ChunkAudioDecoder:
    """The audio VAE over the session's clean latents, sample range by sample range."""

    def __init__(self, decoder: Decoder):
        avae = decoder.components.audio_vae
        self.decoder, self.avae = decoder, avae
        self.halo = halo_latents(avae)
        self.latents: torch.Tensor | None = None  # normalised [2, 32, n], from global latent `base`
        self.base = self.total = 0

    def append(self, latents: torch.Tensor) -> None:
        """A request's clean latents, normalised [2, 32, A]."""
        self.latents = latents if self.latents is None else torch.cat([self.latents, latents], dim=2)
        self.total += latents.shape[2]

    def decode(self, start: int, stop: int) -> torch.Tensor:
        """Samples [start, stop) as float32 [2, n] on the CPU; samples past the generated audio are silence."""
        out = torch.zeros((limits.AUDIO_CHANNELS, stop - start), dtype=torch.float32)
        end = min(stop, self.total * HOP)
        if self.latents is None or end <= start:
            return out
        lo = max(self.base, start // HOP - self.halo)
        hi = min(self.total, -(-end // HOP) + self.halo)
        avae, device = self.avae, self.decoder.device
        mean = torch.tensor(avae.config.latents_mean, device=device).view(1, -1, 1)
        std = torch.tensor(avae.config.latents_std, device=device).view(1, -1, 1)
        z = self.latents[:, :, lo - self.base : hi - self.base].to(device) * std + mean
        wave = avae.decode(z, return_dict=False)[0].float()[:, 0]  # [2, HOP·(hi - lo)]
        out[:, : end - start] = wave[:, start - lo * HOP : end - lo * HOP].cpu()
        keep = min(self.total, max(self.base, stop // HOP - self.halo - 1))
        self.latents, self.base = self.latents[:, :, keep - self.base :], keep
        return out
