"""Streaming decode (`--decode-mode stream`): the VAE's clips one at a time, the same frames and MP4 bytes as the
full decode followed by `write_mp4`, on one rank (the multi-rank cases are in tests/parallel/test_stream_ranks.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from h3serve.media import mp4
from h3serve.media.mp4 import EncoderOptions, write_mp4
from h3serve.media.sink import Mp4Sink
from h3serve.model import audio_windows
from h3serve.model.decoder import SourceHead
from h3serve.model.pipeline_types import Conditioning, StageClock
from h3serve.model.stream_decode import decode_chunks, decoded_frames, rgb8
from h3serve.rules.request import GenerationRequest, MediaRef
from h3serve.rules.validate import validate

FAST = EncoderOptions(preset="ultrafast", threads=1)


@pytest.mark.parametrize(
    ("latent_frames", "latent_hw", "tiles"),
    [
        (12, (4, 6), None),  # 39 frames: 2 clips blended, the last tail
        (9, (4, 6), None),  # 30 frames: padding latents, whose frames are cut at the end
        (3, (4, 6), None),  # 9 frames: one padded clip
        (7, (6, 10), (32, 32, 16, 16)),  # spatial tiles stitched inside every clip
    ],
)
def test_chunks_concatenate_to_the_vaes_own_decode(tiny_pipeline, latent_frames, latent_hw, tiles):
    pipeline, _ = tiny_pipeline
    vae = pipeline.components.vae
    z = torch.randn((1, 24, latent_frames, *latent_hw), generator=torch.Generator().manual_seed(latent_frames))
    saved = (
        vae.tile_sample_min_height,
        vae.tile_sample_min_width,
        vae.tile_sample_min_overlap_height,
        vae.tile_sample_min_overlap_width,
    )
    try:
        if tiles:
            vae.enable_tiling(*tiles)
        with torch.no_grad():
            whole = type(vae)._decode(vae, z)
            pieces = list(decode_chunks(vae, z))
    finally:
        vae.enable_tiling(*saved)
    streamed = torch.cat(pieces, dim=2)
    assert streamed.shape == whole.shape and streamed.shape[2] == decoded_frames(vae, latent_frames)
    assert torch.equal(streamed, whole)
    assert max(p.shape[2] for p in pieces) <= 17 + 5  # one clip's worth at a time, never the whole video
    assert whole.std() > 0.05


def test_rgb8_is_the_full_post_processing_then_the_writers_rounding(tiny_pipeline):
    pipeline, _ = tiny_pipeline
    latents = torch.randn((1, 24, 7, 4, 6), generator=torch.Generator().manual_seed(3)) * 3  # values clamp
    with torch.no_grad():
        full = pipeline.decoder.decode_video(latents).numpy()
        pieces = list(decode_chunks(pipeline.components.vae, pipeline.decoder.denormalised_video(latents)))
    frames = np.concatenate([rgb8(p, 0).numpy() for p in pieces])
    assert np.array_equal(frames, mp4.rgb8(full))
    assert (frames == 0).any() and (frames == 255).any()  # the clamp is exercised at both ends


def test_a_nan_frame_is_refused_with_its_index():
    x = torch.zeros((1, 3, 5, 4, 4))
    x[0, 1, 3, 2, 2] = float("nan")
    with pytest.raises(ValueError, match="video frame 13 contains NaN"):
        rgb8(x, first_frame=10)


def _both_ways(
    pipeline, plan, tmp_path, monkeypatch, cond=None, head=None, reuse_audio=True
) -> tuple[bytes, bytes, object]:
    """The plan decoded whole then written by `write_mp4`, and its latents streamed into an `Mp4Sink` (the
    pipeline's streamed decode after denoising; `generate(..., sink=...)` ends in the same call). With
    `reuse_audio` the streamed pass reuses the full pass's soundtrack (the slowest stage), else it decodes its
    own in windows."""
    with torch.no_grad():
        full = pipeline.generate(plan, cond)
    write_mp4(tmp_path / "full.mp4", full.video.numpy(), full.audio.numpy(), options=FAST)
    sink = Mp4Sink(tmp_path / "stream.mp4", FAST)
    clock = StageClock(pipeline.device)
    # (An extension's source soundtrack is laid over it again: the same samples, so the same array.)
    if reuse_audio:
        monkeypatch.setattr(pipeline.decoder, "decode_audio", lambda latents: full.audio.clone())
    with torch.no_grad():
        streamed = pipeline.decoder.decode(full.video_latents, full.audio_latents, clock, None, sink, head)
    assert streamed.video is None and streamed.num_frames == full.num_frames == plan.num_frames
    assert torch.equal(streamed.audio, full.audio)
    assert set(clock.durations) == {"audio_decode", "video_decode", "mux"}
    return (tmp_path / "full.mp4").read_bytes(), (tmp_path / "stream.mp4").read_bytes(), full


def test_streamed_mp4_has_the_full_decodes_bytes(tiny_pipeline, tmp_path, monkeypatch):
    """The real soundtrack, decoded in the same windows by both modes: 178 audio latents (4 s and its frame
    padding) in windows of 64 latents (halo 16, far ends out by 178 mod 16 = 2; the last one short)."""
    pipeline, defaults = tiny_pipeline
    plan = validate(GenerationRequest(prompt="a fox", width=64, height=32, steps=2, seed=4, duration_s=4), defaults)
    monkeypatch.setattr(audio_windows, "WINDOW_LATENTS", 64)
    avae, lengths = pipeline.components.audio_vae, []
    decode = avae.decode
    monkeypatch.setattr(avae, "decode", lambda z, **kw: lengths.append(z.shape[-1]) or decode(z, **kw))
    full, streamed, _ = _both_ways(pipeline, plan, tmp_path, monkeypatch, reuse_audio=False)
    assert lengths == [82, 98, 66] * 2  # windows [0, 82), [48, 146), [112, 178), full then streamed
    assert full == streamed


def test_extension_streams_its_source_frames_and_soundtrack(tiny_pipeline, tmp_path, monkeypatch):
    pipeline, defaults = tiny_pipeline
    plan = validate(
        GenerationRequest(
            prompt="on",
            width=32,
            height=32,
            steps=2,
            duration_s=4,
            long_video=True,
            long_video_mode="continuation",
            extend_video=MediaRef(Path("/s.mp4"), "s.mp4", "video"),
        ),
        defaults,
        extend_frames=150,
    )
    frames = np.random.default_rng(2).integers(0, 255, (141, 32, 32, 3), dtype=np.uint8)
    wave = torch.from_numpy(np.random.default_rng(3).uniform(-0.5, 0.5, (2, 32_000 * 5)).astype(np.float32))
    cond = Conditioning(extend_video=frames, extend_audio=wave)
    full, streamed, result = _both_ways(pipeline, plan, tmp_path, monkeypatch, cond, SourceHead(frames, wave))
    assert torch.equal(result.audio[:, :1000], wave[:, :1000])  # the source soundtrack leads the output
    assert full == streamed
