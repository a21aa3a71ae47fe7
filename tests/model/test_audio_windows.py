"""The windowed audio VAE decode (h3serve.model.audio_windows): on ATen's native CPU convolutions, whose
summation order does not depend on the length, bit-identical to the whole decode (the halo covers the reach)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3Audio

from h3serve.model.audio_windows import decode_windows, halo_latents
from h3serve.offload.activations import RELEASED_AUDIO_HALO
from h3serve.tools.tiny.presets import AUDIO_OUTPUT_GAIN
from h3serve.tools.tiny.random_init import construct, randomize_


@contextmanager
def native_convolutions() -> Iterator[None]:
    """ATen's own CPU convolutions instead of oneDNN's, whose blocking (and so summation order) follows the shape."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
        with torch.backends.mkldnn.flags(enabled=False):
            yield


@pytest.fixture(scope="module")
def released_structure():
    """The released kernels (3, 7, 11), dilations (1, 3, 5) and rates at a small width (runs in seconds)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*weight_norm.*is deprecated", category=FutureWarning)
        vae = construct(
            AutoencoderKLMiniMaxH3Audio, encoder_dim=4, latent_dim=64, num_attention_heads=2, decoder_dim=128
        )
    randomize_(vae, torch.Generator().manual_seed(1))
    with torch.no_grad():  # as the tiny audio VAE: mostly unclamped output, so the comparisons see real values
        vae.decoder.conv_post.weight_g.mul_(AUDIO_OUTPUT_GAIN)
    return vae.eval()


def _both(vae, length: int, core: int, halo: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.randn((2, 32, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad(), native_convolutions():
        return vae.decode(z, return_dict=False)[0], decode_windows(vae, z, core, halo)


@pytest.mark.parametrize(("length", "core"), [(13, 16), (45, 16), (70, 32)])  # decoded whole; uneven ends
def test_tiny_windows_equal_the_whole_decode(tiny_pipeline, length, core):
    whole, windowed = _both(tiny_pipeline[0].components.audio_vae, length, core)
    assert windowed.shape == whole.shape == (2, 1, 800 * length)
    assert torch.equal(windowed, whole)
    assert whole.std() > 0.01


@pytest.mark.slow
@pytest.mark.parametrize(("length", "core"), [(77, 32), (103, 48)])
def test_released_structure_windows_equal_the_whole_decode(released_structure, length, core):
    assert halo_latents(released_structure) == RELEASED_AUDIO_HALO  # the width does not enter the reach
    whole, windowed = _both(released_structure, length, core)
    assert torch.equal(windowed, whole)
    assert whole.std() > 0.01 and (whole.abs() < 1).float().mean() > 0.9


@pytest.mark.slow
def test_a_halo_below_the_reach_differs(released_structure):
    """The bound (35 latents, aligned to 48) is conservative: the reach's far taps fall below float32's
    rounding, and 32 latents still give the same bits here; 16 do not (so the identity tests can fail)."""
    whole, windowed = _both(released_structure, 77, 32, halo=16)
    assert not torch.equal(windowed, whole)
    assert (windowed - whole).abs().max() < 0.1  # only the far edge of the reach is missing


def test_the_released_vaes_halo_is_the_planners():
    with torch.device("meta"):
        released = AutoencoderKLMiniMaxH3Audio()
    assert released.decoder.ups[0][0].stride == (5,) and released.decoder.num_kernels == 3
    assert halo_latents(released) == RELEASED_AUDIO_HALO
    assert halo_latents(released, alignment=1) == 35


def test_windows_on_the_default_kernels_differ_only_in_rounding(tiny_pipeline):
    """oneDNN (the CPU default) sums in a shape-dependent order: the windows are the whole decode's values up to
    float32 rounding, which is why both decode modes decode in the same windows."""
    vae = tiny_pipeline[0].components.audio_vae
    z = torch.randn((2, 32, 70), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        whole, windowed = vae.decode(z, return_dict=False)[0], decode_windows(vae, z, 32)
    assert (windowed - whole).abs().max() <= 1e-4


def test_window_sizes_are_checked(tiny_pipeline):
    with pytest.raises(ValueError, match="multiple of 16"):
        decode_windows(tiny_pipeline[0].components.audio_vae, torch.zeros((2, 32, 8)), core_latents=24)
