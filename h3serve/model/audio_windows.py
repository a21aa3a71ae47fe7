"""The audio VAE's BigVGAN decode in bounded latent windows, with the whole decode's values.

The decoder (`dec_in_proj`, `conv_pre`, transposed-conv upsamplers, AMP residual blocks of dilated convolutions
behind anti-aliased SnakeBeta activations, `activation_post`, `conv_post`, clamp) is fully convolutional: every
output sample depends on a finite neighbourhood of latents. Decoding the latents [s - halo, e + halo) and keeping
the samples of [s, e) (`hop` = 800 per latent) therefore gives the values of the whole decode, as long as the halo
covers the decoder's one-sided reach; at the sequence's own ends the window ends there too, so the zero and
replicate paddings are the whole decode's. Only one window's working set is alive at a time.

The reach (`halo_latents`) is bounded by walking the decoder's actual modules. A window's "valid" region (the
positions equal to the whole decode's) shrinks at every operator by its one-sided reach, in that operator's
output samples; the shrinks add up along the chain, each scaled to final output samples by the upsampling still
to come, and parallel branches (the AMP blocks summed at one stage) shrink by their largest:
  convolution (stride 1, dilation d, kernel k, padding p): max(p, d·(k-1) - p);
  transposed convolution (stride r, kernel k, padding p): max(k-1-p, p) + 1;
  anti-aliased activation (upsample ratio r and downsample filters of K taps): the upsample's
  max(K-1-pl+r·pad, pl-r·pad) + r (pl, pad: its crop and replicate pad), divided by r, plus the downsample's
  ceil(max(pl, K-1-pl) / r) + 1; pointwise ops (Snake, sums, clamp) add nothing.
Each term rounds up, so the bound is conservative by a few samples per operator. The halo is the total in
latents, rounded up to a multiple of `ALIGNMENT`, so every window starts at a multiple of `ALIGNMENT` latents and
thus at the same phase of every stage's polyphase upsampling and of the CPU kernels' vector blocking.

Both decode modes decode the soundtrack this way, so the streamed and the full MP4 hold the same bits by
construction, on any device. A soundtrack of at most `2·WINDOW_LATENTS` latents (6.4 s) is decoded whole, as
diffusers does, since its whole decode holds no more than two windows would.

How exact the windows are, measured (tests/model/test_audio_windows.py): on ATen's native CPU convolutions the
windows give the whole decode's bits. That needs every window's length congruent to the whole length modulo
`ALIGNMENT` (those kernels copy each channel group to a fresh buffer, so batch item 1 starts 4·L bytes in, and
MKL's gemm treats an unaligned head differently): the far end of every window moves out by A mod `ALIGNMENT`.
oneDNN's convolutions, the CPU default, choose their blocking from the whole shape, so there a window differs
from the whole decode in the last bits (about 1e-5 at most, measured on the tiny audio VAE); cuDNN also chooses
its algorithm per shape. The windowing itself is exact; the kernels' summation order is not length-invariant.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Latents of output per window (3.2 s at 40 latents/s): at 30 s on the tiny audio VAE +117 MB of RSS against
# +307-345 MB whole (256: +177 MB), for 1.16-1.44x the time (docs/benchmarks.md).
WINDOW_LATENTS = 128
ALIGNMENT = 16  # window starts and the halo are multiples of this many latents


def _conv_shrink(conv: nn.Module) -> int:
    """One-sided shrink of a stride-1 `Conv1d`, in its output samples."""
    if conv.stride[0] != 1:
        raise ValueError(f"the audio decoder's convolutions have stride 1, got {conv.stride[0]}")
    span = conv.dilation[0] * (conv.kernel_size[0] - 1)
    pad = conv.padding[0]
    return max(pad, span - pad)


def _transpose_shrink(conv: nn.Module) -> int:
    """One-sided shrink of a `ConvTranspose1d` upsampler, in its output samples."""
    kernel, pad = conv.kernel_size[0], conv.padding[0]
    return max(kernel - 1 - pad, pad) + 1


def _activation_shrink(act: nn.Module) -> int:
    """One-sided shrink of an anti-aliased activation (upsample, Snake, downsample), in its output samples."""
    up, low = act.upsample, act.downsample.lowpass
    taps, ratio = up.filter.shape[-1], up.ratio
    offset = up.pad_left - ratio * up.pad
    upsampled = max(taps - 1 - offset, offset) + ratio  # in the upsampled rate's samples
    taps = low.filter.shape[-1]
    down = math.ceil(max(low.pad_left, taps - 1 - low.pad_left) / low.stride) + 1
    return math.ceil(upsampled / ratio) + down


def _amp_shrink(block: nn.Module) -> int:
    """An AMP block: each dilation's (activation, dilated conv, activation, conv) in sequence."""
    acts = list(block.activations)
    total = 0
    for k, (conv1, conv2) in enumerate(zip(block.convs1, block.convs2, strict=True)):
        total += _activation_shrink(acts[2 * k]) + _conv_shrink(conv1)
        total += _activation_shrink(acts[2 * k + 1]) + _conv_shrink(conv2)
    return total


def _hop(decoder: nn.Module) -> int:
    """Output samples per latent: the product of the upsamplers' strides (800 on H3)."""
    return math.prod(stage[0].stride[0] for stage in decoder.ups)


def halo_latents(audio_vae: nn.Module, alignment: int = ALIGNMENT) -> int:
    """Latents each side of a window that cover the decoder's reach (see the module docstring), rounded up to a
    multiple of `alignment`. Reads only module attributes and buffer shapes: works on the meta device."""
    dec = audio_vae.decoder
    ups = [stage[0] for stage in dec.ups]
    hop = _hop(dec)
    per = dec.num_kernels
    scale = hop  # final output samples per sample of the current stage
    reach = (_conv_shrink(audio_vae.dec_in_proj) + _conv_shrink(dec.conv_pre)) * scale
    for i, up in enumerate(ups):
        scale //= up.stride[0]
        amp = max(_amp_shrink(block) for block in dec.resblocks[i * per : (i + 1) * per])
        reach += (_transpose_shrink(up) + amp) * scale
    reach += _activation_shrink(dec.activation_post) + _conv_shrink(dec.conv_post)
    return math.ceil(math.ceil(reach / hop) / alignment) * alignment


def decode_windows(
    audio_vae: nn.Module, z: torch.Tensor, core_latents: int | None = None, halo: int | None = None
) -> torch.Tensor:
    """`audio_vae.decode(z)` ([B, 32, A] denormalised latents -> [B, 1, hop·A]) window by window into one output.

    Each window decodes `core_latents` (default `WINDOW_LATENTS`, a multiple of `ALIGNMENT`) latents of output
    plus `halo` (default `halo_latents(audio_vae)`) on each side where the sequence has them, its far end moved
    out by A mod `ALIGNMENT` (see the module docstring); up to `2·core_latents` latents, one whole decode."""
    core_latents = WINDOW_LATENTS if core_latents is None else core_latents
    if core_latents <= 0 or core_latents % ALIGNMENT:
        raise ValueError(f"core_latents must be a positive multiple of {ALIGNMENT}, got {core_latents}")
    length = z.shape[-1]
    if length <= 2 * core_latents:
        return audio_vae.decode(z, return_dict=False)[0]
    halo = halo_latents(audio_vae) if halo is None else halo
    hop = _hop(audio_vae.decoder)
    out = None
    for start in range(0, length, core_latents):
        end = min(start + core_latents, length)
        lo, hi = max(start - halo, 0), min(end + halo + length % ALIGNMENT, length)
        wave = audio_vae.decode(z[..., lo:hi], return_dict=False)[0]
        if out is None:
            out = wave.new_empty((*wave.shape[:-1], hop * length))
        out[..., hop * start : hop * end] = wave[..., hop * (start - lo) : hop * (end - lo)]
        del wave
    return out
