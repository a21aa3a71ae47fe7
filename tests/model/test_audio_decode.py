"""The streamlined audio VAE (h3serve.model.audio_decode) decodes the original's bits with less work."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3Audio
from diffusers.models.autoencoders.autoencoder_kl_minimax_h3_audio import (
    MiniMaxH3AudioLowPassFilter1d,
    MiniMaxH3AudioUpSample1d,
)

from h3serve.model import audio_decode
from h3serve.model.audio_decode import LeanLowPassFilter1d, LeanUpSample1d, streamline_audio_vae


@pytest.mark.parametrize("channels", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("length", [1, 5, 63, 1000, 4097])
def test_every_way_of_a_resampler_keeps_its_bits_where_it_is_chosen(channels, length):
    """Segments shorter than their halo, uneven last segments, one sample: each way the CPU check picked gives
    the diffusers module's own bits at lengths the check did not see."""
    x = torch.randn((2, channels, length), generator=torch.Generator().manual_seed(length))
    for original, lean in [(MiniMaxH3AudioUpSample1d(2, 12), LeanUpSample1d),
                           (MiniMaxH3AudioLowPassFilter1d(0.25, 0.3, 2, 12), LeanLowPassFilter1d)]:
        want = original(x)
        original.__class__ = lean
        assert torch.equal(original(x), want)


def test_the_streamlined_decode_has_the_originals_bits(tiny_checkpoint):
    folder = tiny_checkpoint / "audio_vae"
    original = AutoencoderKLMiniMaxH3Audio.from_pretrained(folder).eval()
    lean = streamline_audio_vae(AutoencoderKLMiniMaxH3Audio.from_pretrained(folder).eval())
    assert not any(name.endswith(("weight_g", "weight_v")) for name, _ in lean.named_parameters())  # folded
    z = torch.randn((2, 32, 29), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = original.decode(z, return_dict=False)[0]
        got = lean.decode(z, return_dict=False)[0]
        wave = torch.randn((2, 1, 800 * 13), generator=torch.Generator().manual_seed(1)) * 0.3
        encoded = (original.encode(wave).latent_dist.mode(), lean.encode(wave).latent_dist.mode())
    assert want.abs().max() > 0.01 and torch.equal(got, want)
    assert torch.equal(*encoded)  # the encoder's weight norms are folded too
    # The lean ways were taken on this CPU (else the bits are equal because nothing changed).
    chosen = {key[:2]: way for key, way in audio_decode._ways.items()}
    assert chosen[("up", 2)] != "original" and chosen[("down", 2)] == "segments", chosen


def test_the_ways_are_chosen_at_load_not_on_the_first_decode(tiny_checkpoint, monkeypatch):
    """`streamline_audio_vae` probes every few-channel resampler of the decoder (and encoder) at its Snake's channel
    count, so the first decode finds every way chosen."""
    monkeypatch.setattr(audio_decode, "_ways", {})
    lean = streamline_audio_vae(AutoencoderKLMiniMaxH3Audio.from_pretrained(tiny_checkpoint / "audio_vae").eval())
    chosen = dict(audio_decode._ways)
    assert any(key[0] == "down" for key in chosen) and any(key[0] == "up" for key in chosen)
    probed = []
    monkeypatch.setattr(audio_decode, "_PROBE_LENGTHS", ())  # a probe now would choose from no evidence
    original = audio_decode._cpu_way

    def watched(module, kind, channels, ways):
        key_count = len(audio_decode._ways)
        way = original(module, kind, channels, ways)
        if len(audio_decode._ways) != key_count:
            probed.append((kind, channels))
        return way

    monkeypatch.setattr(audio_decode, "_cpu_way", watched)
    with torch.no_grad():
        lean.decode(torch.randn((2, 32, 21), generator=torch.Generator().manual_seed(2)), return_dict=False)
    assert probed == [] and audio_decode._ways == chosen
