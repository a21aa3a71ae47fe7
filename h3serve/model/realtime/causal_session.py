"""One real-time session: chunk after chunk of causal generation with TaoMate-H3's streaming LoRA.

`CausalSession.run_chunk(prompt)` makes the next chunk of the session (h3serve.rules.realtime_geometry: 39/34/34/17
frames in the first request, 34/34/34/17 after) conditioned on the prompt given for it, and returns the frames and audio
it publishes. Per chunk: the chunk's noise (its request's standalone draw), three student steps (the LoRA on) at the
ladder points (0, 16, 33, 49) in the causal attention over the clean K/V cache, the student's audio rows replaced by the
base model's states 3, 6, 9 after each step; the clean video renormalised to the first chunk's per-feature statistics;
one σ = 0 pass that commits the chunk's keys and values; the decode. At every request's first chunk the audio teacher
(the LoRA off) makes the request's audio with that chunk's prompt, and every 12th request drops the cached audio. The
prompt may change at any chunk boundary: the student reads it from that chunk on, the audio teacher from the next
request on (it makes a request's audio at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from h3serve.model.decoder import Decoder
from h3serve.model.layout import unpatchify
from h3serve.model.pipeline_types import H3Components
from h3serve.model.realtime.causal_attention import CausalAttention
from h3serve.model.realtime.chunk_layout import chunk_layout
from h3serve.model.realtime.decode import ChunkAudioDecoder, ChunkVideoDecoder
from h3serve.model.realtime.kv_cache import CleanKVCache
from h3serve.model.realtime.noise import LATENT_CHANNELS, request_noise
from h3serve.model.realtime.prompt import PromptStates
from h3serve.model.realtime.student_schedule import euler_, student_sigmas
from h3serve.model.realtime.teacher import TeacherAudio, teach
from h3serve.rules import limits
from h3serve.rules.realtime_geometry import (
    STUDENT_STEPS,
    Chunk,
    audio_reset_at,
    chunk,
    chunk_rows,
    kv_rows_bound,
    published_frames,
    request_chunks,
    samples_at,
)


class LoraSwitch(Protocol):
    """Turns the streaming LoRA on (the student) or off (the base model: the audio teacher)."""

    def student(self) -> None: ...
    def base(self) -> None: ...


@dataclass(frozen=True)
class ChunkMedia:
    """What a chunk publishes: frames uint8 [t, H, W, 3] and audio float32 [2, n] on the CPU (empty on a rank that
    does not emit), the first frame's index and the chunk."""

    chunk: Chunk
    first_frame: int
    frames: torch.Tensor
    audio: torch.Tensor


class CausalSession:
    """A session of `chunks` chunks (whole requests) at `width` x `height` from `seed`, on `components`' T2VA DiT.

    `heads`: the attention heads this rank computes (a Ulysses rank's shard). `attention`: the DiT's causal attention
    (made once per DiT and reused by its sessions; by default this session's own, on whole heads). `emit`: whether
    this rank returns media (rank 0; the others still run the collectives)."""

    def __init__(
        self,
        components: H3Components,
        device: torch.device,
        width: int,
        height: int,
        seed: int,
        chunks: int,
        lora: LoraSwitch,
        heads: int | None = None,
        attention: CausalAttention | None = None,
        emit: bool = True,
    ):
        dit = components.transformer
        if dit is None:
            raise ValueError("real-time sessions run on the T2VA DiT, which is not loaded")
        ratio = limits.VAE_SPATIAL_COMPRESSION
        self.dit, self.device, self.lora, self.emit = dit, device, lora, emit
        self.seed, self.chunks = seed, chunks
        self.latent_h, self.latent_w = height // ratio, width // ratio
        self.frame_rows = (self.latent_h // 2) * (self.latent_w // 2)
        cfg = dit.config
        attn = dit.transformer_blocks[0].attn
        self.cache = CleanKVCache(
            len(dit.transformer_blocks), heads or cfg.num_attention_heads, cfg.attention_head_dim,
            kv_rows_bound(self.frame_rows), attn.norm_k.weight.dtype, device,
        )
        self.attention = attention or CausalAttention(dit)
        self.attention.install(self.cache)
        decoder = Decoder(components, device)
        self.video_decoder, self.audio_decoder = ChunkVideoDecoder(decoder), ChunkAudioDecoder(decoder)
        self.sigma_video, self.sigma_audio = student_sigmas()
        self.next = 0  # the next chunk's index
        self.origin: int | None = None  # the media clock's origin: the first prompt's length
        self.anchor: tuple[torch.Tensor, torch.Tensor] | None = None  # the first chunk's clean video statistics
        self.noise: tuple[torch.Tensor, torch.Tensor] | None = None  # the current request's (video rows, audio)
        self.teacher: TeacherAudio | None = None  # the current request's audio

    @property
    def done(self) -> bool:
        return self.next >= self.chunks

    def close(self) -> None:
        """Give the DiT's blocks their own attention back (the cache's memory goes with the session)."""
        self.attention.uninstall()

    @torch.no_grad()
    def run_chunk(self, prompt: PromptStates) -> ChunkMedia:
        """Generate, commit and decode the next chunk, conditioned on `prompt`."""
        if self.done:
            raise RuntimeError(f"the session's {self.chunks} chunks are done")
        c = chunk(self.next)
        if self.origin is None:
            self.origin = prompt.length
        if c.first_in_request:
            self._begin_request(c, prompt)
        clean_video, audio, text, layout = self._denoise(c, prompt)
        self._commit(c, clean_video, audio, text, layout)
        media = self._decode(c, clean_video)
        self.next += 1
        return media

    def _begin_request(self, c: Chunk, prompt: PromptStates) -> None:
        """The request's noise, its audio by the base model, the periodic audio reset of the cache."""
        if audio_reset_at(c.request):
            self.cache.drop_audio()
        last = request_chunks(c.request)[-1]
        video_latents, audio_latents = last.video_stop - c.video_start, last.audio_stop - c.audio_start
        self.noise = request_noise(self.seed, c.request, video_latents, audio_latents, self.latent_h, self.latent_w)
        self.lora.base()
        text = self.dit.embed_text(prompt.states.to(self.device))
        previous = None if self.teacher is None else self.teacher.clean
        self.teacher = teach(self.dit, text, prompt.tags, self.noise[1], previous, self.latent_h, self.latent_w)
        if self.emit:
            self.audio_decoder.append(self.teacher.clean.permute(0, 2, 1))  # [2, 32, A]: the VAE's latents

    def _denoise(self, c: Chunk, prompt: PromptStates):
        """The student's three steps; returns the clean (renormalised) video rows, the clean audio rows, the
        refined text and the chunk's layout."""
        assert self.noise is not None and self.teacher is not None and self.origin is not None
        layout = chunk_layout(prompt.tags, self.origin, c, self.latent_h, self.latent_w)
        packed = layout.packed.to(self.device)
        video_rows, _ = self.noise
        first = (c.video_start - c.request_video_start) * self.frame_rows
        video = video_rows[first : first + c.video_latents * self.frame_rows].to(self.device).clone()
        a0, a1 = c.audio_start - c.request_audio_start, c.audio_stop - c.request_audio_start
        audio = self.noise[1][:, a0:a1].reshape(-1, self.noise[1].shape[-1]).to(self.device)
        self.lora.student()
        text = self.dit.embed_text(prompt.states.to(self.device))
        for step in range(STUDENT_STEPS):
            timestep, row_index = layout.row_timesteps(1.0 - self.sigma_video[step], 1.0 - self.sigma_audio[step])
            with self.attention.chunk(prompt.length, layout.packed.seq_len):
                velocity, _ = self.dit(video[None], audio[None], text, timestep.to(self.device),
                                       row_index.to(self.device), packed)
            euler_(video, velocity[0].float(), self.sigma_video[step], self.sigma_video[step + 1])
            audio = self.teacher.states[step][:, a0:a1].reshape(-1, audio.shape[-1]).to(self.device)
        return self._renormalised(video), audio, text, (layout, packed)

    def _renormalised(self, rows: torch.Tensor) -> torch.Tensor:
        """Clean video rows matched to the session's first chunk's per-feature mean and std (its own anchor)."""
        mean, std = rows.mean(0, keepdim=True), rows.std(0, keepdim=True, unbiased=False).clamp_min(1e-6)
        if self.anchor is None:
            self.anchor = (mean, std)
            return rows
        return (rows - mean).div(std).mul(self.anchor[1]).add(self.anchor[0])

    def _commit(self, c: Chunk, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, layouts) -> None:
        """The σ = 0 pass (t = 1 on every row): each block stages the chunk's clean media keys and values."""
        layout, packed = layouts
        timestep, row_index = layout.row_timesteps(1.0, 1.0)
        try:
            with self.attention.chunk(text.shape[1], layout.packed.seq_len, commit=True):
                self.dit(video[None], audio[None], text, timestep.to(self.device), row_index.to(self.device), packed)
            self.cache.commit(chunk_rows(c, self.frame_rows))
        except BaseException:
            self.cache.rollback()
            raise

    def _decode(self, c: Chunk, video: torch.Tensor) -> ChunkMedia:
        latents = unpatchify(video, LATENT_CHANNELS, c.video_latents, self.latent_h, self.latent_w)
        frames = self.video_decoder.push(latents)
        if c.index == self.chunks - 1:
            frames = torch.cat([frames, self.video_decoder.flush()]) if frames.numel() else self.video_decoder.flush()
        first, count = published_frames(c.index, self.chunks)
        if not self.emit:
            return ChunkMedia(c, first, frames[:0].cpu(), torch.zeros((limits.AUDIO_CHANNELS, 0)))
        if frames.shape[0] != count:
            raise RuntimeError(f"chunk {c.index} decoded {frames.shape[0]} frames, its plan publishes {count}")
        audio = self.audio_decoder.decode(samples_at(first), samples_at(first + count))
        return ChunkMedia(c, first, frames.cpu(), audio)
