"""The audio VAE's BigVGAN decode without its waste, bit for bit (`streamline_audio_vae`, applied at load).

Profiled on the demo checkpoint's audio VAE (4 s, one CPU thread, CPU seconds by module): the anti-aliased
activations' resampling is 62 % of the decode (upsample 34 %, downsample 28 %), SnakeBeta 16 %, the convolutions
that carry the weights 15 %, and the weight-norm hooks recompute every weight on every call. What is wasted, and
what replaces it, each giving the same bits:

- **Weight norm** recomputes `g · v / |v|` in a pre-hook of every convolution on every forward (every window of a
  long soundtrack). It is folded once (`remove_weight_norm`: the same function, so the same weight).
- **The upsampler's `ratio *`** is one more pass over the upsampled signal. With a power-of-two ratio it is folded
  into the filter: scaling by a power of two is exact, so every product and every partial sum is the old one scaled.
- **Depthwise resampling of few channels.** Both resamplers are depthwise convolutions with one shared filter;
  oneDNN vectorises depthwise kernels across channels (16 lanes with AVX-512), so the last stages (1-8 channels over
  the longest signals) leave most lanes idle: an 8-channel stage costs about what a 64-channel one does, and the
  transposed (upsampling) kernel is slower still. On the CPU the signal is cut into overlapping segments stacked
  as channels (`_FOLD_LANES` of them), the same kernel runs over all of them at once, and the overlaps are cut
  away: every output sample is the same taps over the same inputs in the kernel's same order (the halos cover the
  filter's reach), so the bits are equal (tests/model/test_audio_decode.py checks every stage shape). A single
  channel is no depthwise convolution to oneDNN's transposed kernel (it sums in another order), so a one-channel
  upsampler runs as it is.
- **Replicate padding** (both resamplers pad their input by its edge samples) is ATen's replication-pad kernel, which
  took 13 % of the steady decode; a concatenation of the edges and the signal copies the same values into the same
  contiguous layout in half the time (`replicate_pad`).
- **SnakeBeta** allocates five signal-sized temporaries (`alpha·x`, its sine, the square, the scaled square, the
  sum); it now computes in one buffer, the same operations in the same order.

Which way a resampler takes is probed once per channel count and thread count, at load (`choose_cpu_ways`: the
probes cost about as much as the steady decode itself, 0.17 s on the demo's audio VAE, and the first request paid
them before); a decode under another thread count probes for it then.

On other devices (cuDNN chooses its algorithm per shape) only the exact rewrites apply: the weight fold, the ratio
fold and the in-place Snake; the segments are a CPU layout fix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_minimax_h3_audio import (
    MiniMaxH3AudioActivation1d,
    MiniMaxH3AudioLowPassFilter1d,
    MiniMaxH3AudioSnakeBeta,
    MiniMaxH3AudioUpSample1d,
)
from torch import nn
from torch.nn.utils.weight_norm import WeightNorm

# Channels x segments a folded resampler runs as (64: four AVX-512 or eight AVX2 vectors of lanes); stages with at
# least `_FOLD_BELOW` channels already fill the kernel's vectors and run as they are.
_FOLD_LANES = 64
_FOLD_BELOW = 16
_PROBE_LENGTHS = (997, 20_011)  # signal lengths a CPU way is checked on before it is used (odd: uneven segments)
# (kind, channels, taps, stride, threads, oneDNN on) -> the way chosen
_ways: dict[tuple[str, int, int, int, int, bool], str] = {}


def streamline_audio_vae(audio_vae: nn.Module) -> nn.Module:
    """Fold the weight norms and give the resamplers and activations their lean forwards, in place; on the CPU,
    each resampler's way is chosen now (`choose_cpu_ways`), not on the first decode."""
    for module in audio_vae.modules():
        if any(isinstance(hook, WeightNorm) for hook in module._forward_pre_hooks.values()):
            torch.nn.utils.remove_weight_norm(module)
        if type(module) is MiniMaxH3AudioUpSample1d:
            module.__class__ = LeanUpSample1d
        elif type(module) is MiniMaxH3AudioLowPassFilter1d:
            module.__class__ = LeanLowPassFilter1d
        elif type(module) is MiniMaxH3AudioSnakeBeta:
            module.__class__ = InPlaceSnakeBeta
    choose_cpu_ways(audio_vae)
    return audio_vae


def choose_cpu_ways(audio_vae: nn.Module) -> None:
    """Probe, for every anti-aliased activation on the CPU, the way its resamplers run at its channel count (the
    Snake's), with the thread count set now: the probes cost about 0.17 s on the demo's audio VAE, which the first
    decode paid before. A decode under another thread count probes again for it."""
    for module in audio_vae.modules():
        if isinstance(module, MiniMaxH3AudioActivation1d) and isinstance(module.upsample, LeanUpSample1d):
            if module.upsample.filter.device.type != "cpu":
                continue
            channels = module.act.alpha.numel()
            module.upsample.cpu_way(channels)
            if isinstance(module.downsample.lowpass, LeanLowPassFilter1d):
                module.downsample.lowpass.cpu_way(channels)


def _cpu_way(module: LeanUpSample1d | LeanLowPassFilter1d, kind: str, channels: int, ways: tuple[str, ...]) -> str:
    """The first of `ways` that gives this resampler's own bits on this CPU for `channels` channels (checked once
    on random signals, then remembered), else "original". The kernels' order of summation is not documented and
    may differ between instruction sets, so it is measured, never assumed."""
    key = (kind, channels, module.filter.shape[-1], module.stride, torch.get_num_threads(),
           torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)
    if key not in _ways:
        generator = torch.Generator().manual_seed(channels)
        probes = [torch.randn(2, channels, n, generator=generator) for n in _PROBE_LENGTHS]
        original = type(module).__mro__[1].forward  # the diffusers class's own forward
        wanted = [original(module, probe) for probe in probes]
        _ways[key] = next(
            (way for way in ways
             if all(torch.equal(module.run(probe, way), want) for probe, want in zip(probes, wanted, strict=True))),
            "original",
        )
    return _ways[key]


def replicate_pad(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """`F.pad(x, (left, right), mode="replicate")` as a concatenation: the same values in the same contiguous layout,
    about twice as fast on the CPU (ATen's replication-pad kernel was 13 % of the steady decode)."""
    edges = x.shape[:-1]
    return torch.cat([x[..., :1].expand(*edges, left), x, x[..., -1:].expand(*edges, right)], dim=-1)


class LeanUpSample1d(MiniMaxH3AudioUpSample1d):
    """`ratio`x upsampler: the ratio in the filter; on the CPU few channels folded into segments (one depthwise
    kernel at full width) or, where that kernel sums differently, the filter's phases accumulated tap by tap."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.device.type != "cpu":
            return self.run(hidden_states, "scaled")
        return self.run(hidden_states, self.cpu_way(hidden_states.shape[1]))

    def cpu_way(self, channels: int) -> str:
        ways = ("segments", "phases", "scaled") if channels < _FOLD_BELOW else ("scaled",)
        return _cpu_way(self, "up", channels, ways)

    def run(self, hidden_states: torch.Tensor, way: str) -> torch.Tensor:
        if way == "original":
            return super().forward(hidden_states)
        channels, length = hidden_states.shape[1], hidden_states.shape[-1]
        padded = replicate_pad(hidden_states, self.pad, self.pad)
        ratio, taps = self.stride, self.filter.shape[-1]
        weight = self.filter * self.ratio  # a power of two scales every product and sum exactly (the probe checks)
        if way == "phases":
            # Output n sums xp[i]·f[k] over ratio·i + k = n in the order of k, from zero, as oneDNN's one-channel
            # transposed kernel does: each phase of the output accumulates its taps in turn.
            out = padded.new_zeros((*padded.shape[:-1], (padded.shape[-1] - 1) * ratio + taps))
            for k in range(taps):
                out[..., k : k + ratio * padded.shape[-1] : ratio] += padded * weight[0, 0, k]
            return out[..., self.pad_left : -self.pad_right]
        if way == "scaled":
            out = F.conv_transpose1d(padded, weight.expand(channels, -1, -1), stride=ratio, groups=channels)
            return out[..., self.pad_left : -self.pad_right]
        # Segments: the kept outputs are [pad_left, pad_left + ratio·length); segment j keeps `kept` of them,
        # reading the inputs from `first + j·step` on (`width` of them).
        segments = max(1, _FOLD_LANES // channels)
        step = math.ceil(length / segments)
        kept = ratio * step
        first = (self.pad_left - taps + 1) // ratio  # the first input a segment's first kept output reads
        width = (self.pad_left + kept - 1) // ratio - first + 1  # inputs its kept outputs read
        lead = max(0, -first)
        tail = max(0, (segments - 1) * step + first + width - padded.shape[-1])
        padded = F.pad(padded, (lead, tail))  # zeros no kept output reads (see `first` and `width`)
        pieces = padded[..., first + lead :].unfold(-1, width, step)  # [B, C, segments, width]
        pieces = pieces.reshape(padded.shape[0], channels * segments, width)
        out = F.conv_transpose1d(pieces, weight.expand(channels * segments, -1, -1), stride=ratio,
                                 groups=channels * segments)
        start = self.pad_left - ratio * first
        out = out[..., start : start + kept].reshape(padded.shape[0], channels, segments * kept)
        return out[..., : ratio * length]


class LeanLowPassFilter1d(MiniMaxH3AudioLowPassFilter1d):
    """The strided low-pass (the downsampler); on the CPU few channels folded into segments."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.device.type != "cpu":
            return super().forward(hidden_states)
        return self.run(hidden_states, self.cpu_way(hidden_states.shape[1]))

    def cpu_way(self, channels: int) -> str:
        ways = ("padded",) if channels >= _FOLD_BELOW else ("segments", "padded")
        return _cpu_way(self, "down", channels, ways)

    def run(self, hidden_states: torch.Tensor, way: str) -> torch.Tensor:
        if way == "original":
            return super().forward(hidden_states)
        channels = hidden_states.shape[1]
        padded = replicate_pad(hidden_states, self.pad_left, self.pad_right)
        if way == "padded":  # the original with the fast replicate pad
            return F.conv1d(padded, self.filter.expand(channels, -1, -1), stride=self.stride, groups=channels)
        segments = max(1, _FOLD_LANES // channels)
        taps, stride = self.filter.shape[-1], self.stride
        outputs = (padded.shape[-1] - taps) // stride + 1
        step = math.ceil(outputs / segments)  # outputs per segment
        width = stride * (step - 1) + taps
        tail = max(0, stride * step * (segments - 1) + width - padded.shape[-1])
        padded = F.pad(padded, (0, tail))  # zeros only the cut-off outputs past the end read
        pieces = padded.unfold(-1, width, stride * step).reshape(padded.shape[0], channels * segments, width)
        out = F.conv1d(pieces, self.filter.expand(channels * segments, -1, -1), stride=stride,
                       groups=channels * segments)
        return out.reshape(padded.shape[0], channels, segments * step)[..., :outputs]


class InPlaceSnakeBeta(MiniMaxH3AudioSnakeBeta):
    """`x + (exp(beta) + 1e-9)^-1 · sin(exp(alpha) · x)^2` in one buffer (the same operations, the same order)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha.unsqueeze(0).unsqueeze(-1))
        inverse_beta = (torch.exp(self.beta.unsqueeze(0).unsqueeze(-1)) + 1e-9).reciprocal()
        out = alpha * hidden_states
        out.sin_()
        out.mul_(out)  # pow(2) is x·x in ATen
        out.mul_(inverse_beta)
        return out.add_(hidden_states)
