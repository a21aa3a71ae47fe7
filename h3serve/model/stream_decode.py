"""Streaming video decode: the VAE's temporal clips decoded one at a time, each released as uint8 frames.

`AutoencoderKLMiniMaxH3._decode` decodes clips of `tokens_chunk_size + token_overlap` latent frames, keeps
`chunk_num_frames - frame_pre_padding` pixel frames of each, cross-fades a clip's first `frame_overlap` frames
with the previous clip's tail, appends the last tail, then cuts the frames that repeated padding latents made.
`decode_chunks` walks the same clips with the same arithmetic (the VAE's own `_blend`; the tiles stitched in
place by h3serve.model.tile_stitch) but yields each piece as soon as it is final, so the concatenation of what
it yields equals `_decode(z)` bit for bit while only one clip (and a copy of its tail) is alive at a time.
`rgb8` is the post-processing of the full decode (denormalise, clamp) followed by the MP4 writer's rounding, on
the device, frame by frame.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from h3serve.model.tile_stitch import decode_clip
from h3serve.rules import limits


def _pad_frames(vae: nn.Module, latent_frames: int, pad_tokens: int, chunk: int) -> int:
    """Pixel frames the `pad_tokens` repeated latents produce (a clip's last latent covers fewer frames)."""
    ratio = vae.temporal_compression_ratio
    intra_tail = vae.config.clip_length % ratio
    return sum(intra_tail if intra_tail and (latent_frames + k) % chunk == 0 else ratio for k in range(pad_tokens))


def decoded_frames(vae: nn.Module, latent_frames: int) -> int:
    """How many pixel frames `decode_chunks` yields for `latent_frames` latents (17n+5 for 5n+2 on H3)."""
    chunk, ratio, token_drop = vae.tokens_chunk_size, vae.temporal_compression_ratio, vae.config.token_drop
    num_tokens = latent_frames + token_drop
    pad_tokens = (-num_tokens) % chunk
    num_chunks = (num_tokens + pad_tokens) // chunk - int(token_drop > 0)
    clip = (chunk + vae.token_overlap) * ratio  # the decoder unfolds each latent into `ratio` frames
    kept = min(chunk * ratio, clip) - vae.frame_pre_padding
    tail = max(clip - chunk * ratio - vae.frame_pre_padding, 0) if token_drop > 0 else 0
    pad = _pad_frames(vae, latent_frames, pad_tokens, chunk) if pad_tokens else 0
    return num_chunks * kept + tail - pad


def decode_chunks(vae: nn.Module, z: torch.Tensor) -> Iterator[torch.Tensor]:
    """Decoder-space frames [1, C, t, H, W] of de-normalised latents `z`, in order, clip by clip.

    VAE tile parallelism installs its own `_decode_clip` on the instance (h3serve.parallel.vae_tiles): where it
    returns None (a rank other than 0) nothing is yielded, but every clip is still visited so the ranks'
    collectives stay in step. Yielded pieces may be views of the clip: use them before asking for the next.
    """
    clip_decoder = vae.__dict__.get("_decode_clip") or (lambda clip_latents: decode_clip(vae, clip_latents))
    chunk = vae.tokens_chunk_size
    token_drop = vae.config.token_drop
    chunk_num_frames = chunk * vae.temporal_compression_ratio
    latent_frames = z.shape[2]
    num_tokens = latent_frames + token_drop
    pad_tokens = (-num_tokens) % chunk
    num_chunks = (num_tokens + pad_tokens) // chunk - int(token_drop > 0)
    if pad_tokens > 0:
        z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad_tokens, 1, 1)], dim=2)
    hold = _pad_frames(vae, latent_frames, pad_tokens, chunk) if pad_tokens else 0
    held: torch.Tensor | None = None  # the last `hold` frames released so far: the padding, cut at the end

    def release(piece: torch.Tensor) -> Iterator[torch.Tensor]:
        nonlocal held
        if hold == 0:
            yield piece
            return
        piece = piece if held is None else torch.cat([held, piece], dim=2)
        if piece.shape[2] > hold:
            yield piece[:, :, :-hold]
        held = piece[:, :, -hold:].clone()

    overlap = None
    for i in range(num_chunks):
        clip = clip_decoder(z[:, :, i * chunk : i * chunk + chunk + vae.token_overlap])
        if clip is None:
            continue
        piece = clip[:, :, vae.frame_pre_padding : chunk_num_frames]
        if token_drop > 0:
            tail = clip[:, :, chunk_num_frames : 2 * chunk_num_frames][:, :, vae.frame_pre_padding :]
            tail = tail.clone()  # alone, so that the clip is freed before the next one decodes
        del clip  # `piece` keeps its storage until the piece is released
        if overlap is not None:
            # `_blend(overlap, piece)`'s values, written over the piece's head inside the clip.
            extent = min(overlap.shape[2], piece.shape[2], vae.frame_overlap)
            head = piece[:, :, :extent]
            head.copy_(vae._blend(overlap, head, extent, dim=-3))
            del head
        yield from release(piece)
        del piece
        if token_drop > 0:
            overlap = tail
            del tail
    if overlap is not None:
        yield from release(overlap)


def rgb8(x: torch.Tensor, first_frame: int) -> torch.Tensor:
    """Decoder-space frames [1, 3, t, H, W] -> uint8 RGB [t, H, W, 3] on the same device.

    The full decode's order (float32, ×std, +mean, clamp to [0, 1]) and then the MP4 writer's (×255, round half
    to even, clip), each element by element, so a streamed MP4 holds the bytes of the whole-array one. Frame by
    frame, so its float temporaries are one frame's. `first_frame` names a frame in the NaN error, as the writer
    does."""
    std = torch.tensor(limits.PIXEL_STD, device=x.device).view(1, -1, 1, 1)
    mean = torch.tensor(limits.PIXEL_MEAN, device=x.device).view(1, -1, 1, 1)
    frames = x.shape[2]
    out = torch.empty((frames, *x.shape[-2:], 3), dtype=torch.uint8, device=x.device)
    finite = torch.empty(frames, dtype=torch.bool, device=x.device)
    for f in range(frames):
        frame = (x[:, :, f].float() * std + mean).clamp_(0, 1)  # [1, 3, H, W]
        finite[f] = torch.isfinite(frame).all()
        out[f] = frame.mul_(255.0).round_().clamp_(0, 255).to(torch.uint8)[0].permute(1, 2, 0)
    if not bool(finite.all()):  # one device sync per piece, not per frame
        bad = int((~finite).nonzero()[0, 0])
        raise ValueError(f"video frame {first_frame + bad} contains NaN or inf")
    return out
