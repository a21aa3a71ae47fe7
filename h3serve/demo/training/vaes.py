"""The demo checkpoint's VAEs trained as autoencoders on the demo world (h3serve.demo.world).

Both are the diffusers classes the released checkpoint uses, at the demo preset's sizes, trained through their own
`encode`/`decode` (the video VAE's clip chunking and causal first frame, the audio VAE's hop of 800), so the latents
the DiT learns are exactly the ones the pipeline reads and writes. After training, `latents_mean`/`latents_std` are
measured on the world's clips, as the release normalises its latents per channel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from h3serve.demo.world import scenes as world
from h3serve.demo.world.grammar import BACKGROUND_RGB, Attributes
from h3serve.rules import limits

# One video VAE clip: 22 frames = 17 + 5, the shortest length the pipeline encodes (7 latent frames), decoded by
# one temporal chunk of the decoder, as every window of a request is.
VIDEO_CLIP_FRAMES = 22
AUDIO_CROP_SAMPLES = 16_000  # 0.5 s
CROP_LATENTS = AUDIO_CROP_SAMPLES // world.SAMPLES_PER_LATENT  # 20 audio latents
FOREGROUND_WEIGHT = 8.0  # the object covers ~3 % of the canvas: its pixels weigh this much more than background
VIDEO_KL_WEIGHT = 1e-6
INITIAL_LOGVAR = -10.0  # the posterior starts near-deterministic: keyframe conditions sample it (seed 42)
AUDIO_MSE_WEIGHT = 20.0
# Of each audio batch, this many crops are the click alone, switched on in a random BURST_SHARE of their latents,
# and in the learning rate's warm-up (AUDIO_WARMUP of the steps) every crop is. The world's clicks fill under 2 % of
# its latents and the stage never learnt them from the world alone (no click reproduced in nine trials, even with
# extra clicks added to the world's crops); with the burst crops it reproduces every click of the world's bouncing
# soundtracks on two seeds of two, without the burst-only warm-up on one (docs/demo_lab_notebook.md, run 8).
AUDIO_BURST_CROPS = 2
BURST_SHARE = 0.3
AUDIO_WARMUP = 0.1

LossLog = Callable[[str, int, float], None]  # (stage, step, loss)


@dataclass(frozen=True)
class Canvas:
    """The demo canvas the world is rendered on."""

    width: int = 128
    height: int = 64


def normalised_pixels(frames: np.ndarray) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> the VAE's input space [3, T, H, W] (ImageNet-normalised)."""
    x = torch.from_numpy(frames).permute(3, 0, 1, 2).float().div_(255.0)
    mean = torch.tensor(limits.PIXEL_MEAN).view(3, 1, 1, 1)
    std = torch.tensor(limits.PIXEL_STD).view(3, 1, 1, 1)
    return (x - mean) / std


def video_batch(rng: np.random.Generator, batch: int, canvas: Canvas) -> torch.Tensor:
    """`batch` random 22-frame clips [B, 3, 22, H, W] from anywhere in the world (random starts and motions)."""
    clips = []
    for _ in range(batch):
        task = "t2va" if rng.random() < 0.3 else "fl2va"
        scene = world.sample_scene(rng, task, canvas.width, canvas.height, VIDEO_CLIP_FRAMES)
        clips.append(normalised_pixels(world.render_video(scene)))
    return torch.stack(clips)


def train_video_vae(vae, steps: int, canvas: Canvas, seed: int, log: LossLog, batch: int = 2, lr: float = 2e-3):
    """Reconstruction (foreground-weighted MSE in the VAE's pixel space) plus a small KL, through encode/decode."""
    rng = np.random.default_rng(seed)
    device = next(vae.parameters()).device  # the batches are drawn on the CPU and moved there
    generator = torch.Generator(device).manual_seed(seed)
    background = normalised_pixels(np.array(BACKGROUND_RGB, dtype=np.uint8).reshape(1, 1, 1, 3)).to(device)
    vae.train().requires_grad_(True)
    with torch.no_grad():  # the moments' second half is the log-variance: start it small
        vae.quant_conv.bias[vae.config.latent_channels :] = INITIAL_LOGVAR
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        x = video_batch(rng, batch, canvas).to(device)
        posterior = vae.encode(x).latent_dist
        y = vae.decode(posterior.sample(generator=generator)).sample
        weight = 1.0 + FOREGROUND_WEIGHT * ((x - background).abs().amax(dim=1, keepdim=True) > 0.3).float()
        kl = posterior.kl().mean() / posterior.mean[0].numel()  # per latent element
        loss = (weight * (y - x).pow(2)).mean() + VIDEO_KL_WEIGHT * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        log("video_vae", step, float(loss.detach()))
    vae.eval().requires_grad_(False)


def audio_batch(rng: np.random.Generator, batch: int, bursts: int = AUDIO_BURST_CROPS) -> torch.Tensor:
    """`batch` mono 0.5 s crops [B, 1, 16000] starting on the latent grid, as a request's soundtrack is encoded: the
    first `bursts` the click alone in a random BURST_SHARE of their latents (`_burst_crop`), the others the
    world's soundtracks (half of them bouncing, with their clicks)."""
    crops = [_burst_crop(rng) for _ in range(min(batch, bursts))]
    while len(crops) < batch:
        attrs = world.random_attributes(rng)
        if rng.random() < 0.5:
            attrs = Attributes(attrs.color, attrs.shape, "bouncing", attrs.sound)
        scene = world.sample_scene(rng, "fl2va", 128, 64, 39, attrs)
        wave = world.render_audio(scene)  # [2, N], 39 frames: 1.6 s
        first = int(rng.integers(0, wave.shape[1] // world.SAMPLES_PER_LATENT - CROP_LATENTS + 1))
        start = first * world.SAMPLES_PER_LATENT
        crops.append(torch.from_numpy(wave[int(rng.integers(2)), start : start + AUDIO_CROP_SAMPLES].copy()))
    return torch.stack(crops)[:, None]


def _burst_crop(rng: np.random.Generator) -> torch.Tensor:
    """A crop of silence with the world's click in a random BURST_SHARE of its latents, float32 [16000]."""
    on = np.repeat(rng.random(CROP_LATENTS) < BURST_SHARE, world.SAMPLES_PER_LATENT)
    return torch.from_numpy((world.click_wave(0, AUDIO_CROP_SAMPLES) * on).astype(np.float32))


def train_audio_vae(audio_vae, steps: int, seed: int, log: LossLog, batch: int = 4, lr: float = 1e-3):
    """Waveform MSE through encode (posterior mean) and decode.

    Spectral-magnitude losses do not work on this world: its spectra are nearly empty (one tone), so silence is a
    deep minimum of any magnitude loss and the decoder collapses into it within tens of steps; the waveform's own
    error keeps pointing at the signal. The decoder's output gain (`conv_post.weight_g`, tiny at the start) stays
    fixed: Adam's first steps would otherwise drive it to zero before anything else learns."""
    rng = np.random.default_rng(seed)
    device = next(audio_vae.parameters()).device
    audio_vae.train().requires_grad_(True)
    audio_vae.decoder.conv_post.weight_g.requires_grad_(False)
    trained = [p for p in audio_vae.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=AUDIO_WARMUP)
    warmup = round(AUDIO_WARMUP * steps)
    for step in range(steps):
        x = audio_batch(rng, batch, batch if step < warmup else AUDIO_BURST_CROPS).to(device)
        y = audio_vae.decode(audio_vae.encode(x).latent_dist.mode()).sample
        loss = AUDIO_MSE_WEIGHT * (y - x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        schedule.step()
        log("audio_vae", step, float(loss.detach()))
    audio_vae.eval().requires_grad_(False)


@torch.no_grad()
def set_latent_stats(vae, audio_vae, canvas: Canvas, seed: int, clips: int = 48) -> None:
    """Measure the per-channel mean and std of both VAEs' posterior means on the world and store them in the
    configs, as the release's `latents_mean`/`latents_std` (rounded to keep the JSON short)."""
    rng = np.random.default_rng(seed)
    video, audio = [], []
    for _ in range(clips):
        scene = world.sample_scene(rng, "fl2va", canvas.width, canvas.height, VIDEO_CLIP_FRAMES)
        z = vae.encode(normalised_pixels(world.render_video(scene))[None]).latent_dist.mode()
        video.append(z[0].flatten(1))
        wave = torch.from_numpy(world.render_audio(scene))[:, None]
        audio.append(audio_vae.encode(wave).latent_dist.mode().permute(1, 0, 2).flatten(1))
    for model, latents in ((vae, torch.cat(video, 1)), (audio_vae, torch.cat(audio, 1))):
        mean = [round(float(v), 5) for v in latents.mean(1)]
        std = [round(max(float(v), 1e-3), 5) for v in latents.std(1)]
        model.register_to_config(latents_mean=mean, latents_std=std)
