"""Long video on the tiny checkpoint: a 30 s one-pass request and a 40 s continuation (3 windows of 345 frames).

Smallest canvas (32x32, one DiT token per latent frame) and 2 grid points (one forward per window) keep this fast;
the audio VAE decode of 30-40 s dominates, so each long decode runs once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3serve.media.mp4 import write_mp4
from h3serve.media.output_probe import check_output_contract, probe
from h3serve.rules import geometry
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate

PROMPTS = ("dawn over the sea", "a boat appears", "night falls")


def continuation_plan(defaults, seed=7, duration_s=40, window=345):
    request = GenerationRequest(
        prompt="a beach", width=32, height=32, steps=1, seed=seed, duration_s=duration_s, long_video=True,
        long_video_mode="continuation", continuation_window_frames=window, continuation_prompts=PROMPTS,
    )
    return validate(request, defaults)


class Spy:
    """Records each continuation window's inputs (guide, presentation) and outputs (latents), and progress."""

    def __init__(self, pipeline, monkeypatch, decode=True):
        self.windows: list[dict] = []
        self.progress: list[tuple[int, int]] = []
        original = pipeline.continuation.run_window

        def run_window(plan, window, media, text, media_origin, guide, clock, on_step, locked=None):
            record = {"window": window, "guide": guide, "ids": list(text.ids), "origin": media_origin}
            self.windows.append(record)
            record["latents"] = original(plan, window, media, text, media_origin, guide, clock, on_step, locked)
            return record["latents"]

        monkeypatch.setattr(pipeline.continuation, "run_window", run_window)
        if not decode:  # latents only: the stitched result without the (slow, already tested) decode
            monkeypatch.setattr(pipeline.decoder, "decode", lambda video, audio, clock, cache, *sink: (video, audio))

    def on_step(self, done: int, total: int) -> None:
        self.progress.append((done, total))


@pytest.fixture(scope="module")
def continuation(tiny_pipeline, tmp_path_factory):
    pipeline, defaults = tiny_pipeline
    plan = continuation_plan(defaults)
    with pytest.MonkeyPatch.context() as mp:
        spy = Spy(pipeline, mp)
        result = pipeline.generate(plan, on_step=spy.on_step)
    path = tmp_path_factory.mktemp("long") / "continuation.mp4"
    write_mp4(path, result.video.numpy(), result.audio.numpy())
    return plan, result, spy, probe(path)


def test_continuation_output_counts_and_mp4(continuation):
    plan, result, spy, probed = continuation
    assert plan.num_frames == 974 and [(w.start, w.end) for w in plan.windows] == [(0, 345), (323, 668), (646, 974)]
    assert result.video.shape == (974, 32, 32, 3)
    assert result.audio.shape == (2, 800 * geometry.audio_latents(974))
    assert result.video_latents.shape[2] == geometry.latent_frames(974) == 287
    assert result.audio_latents.shape[2] == geometry.audio_latents(974) == 1623
    assert check_output_contract(probed) == [] and probed.nb_frames == 974


def test_guide_is_the_previous_windows_final_latents_bit_for_bit(continuation):
    _, result, spy, _ = continuation
    assert spy.windows[0]["guide"] is None
    for prev, record in zip(spy.windows, spy.windows[1:], strict=False):
        video, audio = prev["latents"]
        guide, window = record["guide"], record["window"]
        n = window.overlap_audio_latents  # on the global timeline: 575 - 538 = 37, then 1113 - 1077 = 36
        assert guide.video.shape[2] == window.overlap_latent_frames == 7 and guide.audio.shape[2] == n
        assert torch.equal(guide.video, video[:, :, -7:]) and torch.equal(guide.audio, audio[:, :, -n:])
    assert [r["window"].overlap_audio_latents for r in spy.windows] == [0, 37, 36]


def test_stitch_is_a_hard_cut_of_each_windows_latents(continuation):
    _, result, spy, _ = continuation
    parts_v = [r["latents"][0][:, :, r["window"].overlap_latent_frames :] for r in spy.windows]
    parts_a = [r["latents"][1][:, :, r["window"].overlap_audio_latents :] for r in spy.windows]
    assert torch.equal(result.video_latents, torch.cat(parts_v, dim=2))
    assert torch.equal(result.audio_latents, torch.cat(parts_a, dim=2))


def test_per_window_prompts_share_one_media_clock(continuation, tiny_pipeline):
    pipeline, _ = tiny_pipeline
    _, _, spy, _ = continuation
    tokenizer = pipeline.components.text.tokenizer
    for record, prompt in zip(spy.windows, PROMPTS, strict=True):
        assert record["ids"] == tokenizer(f"a beach {prompt}", add_special_tokens=False)["input_ids"]
    assert {r["origin"] for r in spy.windows} == {float(max(len(r["ids"]) for r in spy.windows))}


def test_progress_is_monotonic_over_the_whole_request(continuation):
    plan, _, spy, _ = continuation
    done = [d for d, _ in spy.progress]
    assert {t for _, t in spy.progress} == {3} == {plan.forwards}  # 3 windows x 1 forward: the job's progress_steps
    assert done == [1, 1, 2, 2, 3]  # a step in each window, and a (cancellation) call between windows


def test_same_seed_same_latents_and_distinct_noise_per_window(continuation, tiny_pipeline, monkeypatch):
    pipeline, _ = tiny_pipeline
    plan, result, first, _ = continuation
    Spy(pipeline, monkeypatch, decode=False)
    video, audio = pipeline.generate(plan)
    assert torch.equal(video, result.video_latents) and torch.equal(audio, result.audio_latents)
    # Window i draws from seed + i: the two full-size windows' generated latents differ from the first frame on.
    (v0, _), (v1, _) = first.windows[0]["latents"], first.windows[1]["latents"]
    assert not torch.equal(v0[:, :, 7:14], v1[:, :, 7:14])


class Stop(Exception):
    pass


@pytest.mark.parametrize("raise_at_call, windows_finished", [(3, 1), (4, 2)])
def test_cancellation_within_and_between_windows(tiny_pipeline, monkeypatch, raise_at_call, windows_finished):
    """Progress calls: #1 in window 0, #2 before window 1, #3 in window 1 (within), #4 before window 2 (between)."""
    pipeline, defaults = tiny_pipeline
    spy = Spy(pipeline, monkeypatch, decode=False)
    calls = []

    def on_step(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == raise_at_call:
            raise Stop

    with pytest.raises(Stop):
        pipeline.generate(continuation_plan(defaults, duration_s=11.5, window=107), on_step=on_step)  # 3 x 107
    assert len(spy.windows) == 2  # window 2 never starts
    assert len([r for r in spy.windows if "latents" in r]) == windows_finished


def test_full_mode_30_s_is_one_pass_of_the_snapped_frame_count(tiny_pipeline, tmp_path):
    pipeline, defaults = tiny_pipeline
    plan = validate(GenerationRequest(prompt="x", width=32, height=32, steps=1, duration_s=30, long_video=True),
                    defaults)
    steps = []
    result = pipeline.generate(plan, on_step=lambda done, total: steps.append((done, total)))
    assert (plan.long_video_mode, plan.num_frames, steps) == ("full", 736, [(1, 1)])
    assert result.video.shape == (736, 32, 32, 3) and result.audio.shape == (2, 800 * 1227)
    write_mp4(tmp_path / "full.mp4", result.video.numpy(), result.audio.numpy())
    probed = probe(tmp_path / "full.mp4")
    assert check_output_contract(probed) == [] and probed.nb_frames == 736


def test_lock_source_holds_the_driving_audio_across_windows(tiny_pipeline, monkeypatch):
    from pathlib import Path

    from h3serve.model.conditioning import encode_audio_condition
    from h3serve.model.pipeline_types import Conditioning
    from h3serve.rules.request import MediaRef

    pipeline, defaults = tiny_pipeline
    plan = validate(GenerationRequest(
        prompt="a drum", width=32, height=32, steps=1, duration_s=11.5, long_video=True,
        long_video_mode="continuation", continuation_window_frames=107, audio_mode="lock_source",
        source_audio=MediaRef(Path("/d.wav"), "d.wav", "audio")), defaults)
    wave = torch.from_numpy(np.random.default_rng(1).uniform(-0.5, 0.5, (2, 32_000 * 3)).astype(np.float32))
    Spy(pipeline, monkeypatch, decode=False)
    _, audio = pipeline.generate(plan, Conditioning(edit_audio=wave))
    rows = encode_audio_condition(pipeline.components.audio_vae, wave)
    clean = rows.reshape(2, -1, rows.shape[-1]).permute(0, 2, 1)  # 120 latents (3 s), then held silence
    assert len(plan.windows) == 3 and torch.equal(audio[:, :, :120], clean) and not audio[:, :, 120:].any()


def test_extension_window_zero_is_the_source_and_its_tail_the_first_guide(tiny_pipeline, monkeypatch):
    from pathlib import Path

    from h3serve.model.conditioning import encode_visual_condition
    from h3serve.model.pipeline_types import Conditioning
    from h3serve.rules.request import MediaRef

    pipeline, defaults = tiny_pipeline
    plan = validate(GenerationRequest(
        prompt="on", width=32, height=32, steps=1, duration_s=4, long_video=True, long_video_mode="continuation",
        extend_video=MediaRef(Path("/s.mp4"), "s.mp4", "video")), defaults, extend_frames=150)
    frames = np.random.default_rng(2).integers(0, 255, (141, 32, 32, 3), dtype=np.uint8)
    spy = Spy(pipeline, monkeypatch)
    result = pipeline.generate(plan, Conditioning(extend_video=frames), on_step=spy.on_step)
    source = encode_visual_condition(pipeline.components.vae, torch.from_numpy(frames).permute(3, 0, 1, 2)[None])
    (record,) = spy.windows  # only the new part is generated
    assert (record["window"].start, record["window"].end) == (119, 243)
    assert torch.equal(record["guide"].video, source[:, :, -7:]) and not record["guide"].audio.any()  # no soundtrack
    assert torch.equal(result.video_latents[:, :, : source.shape[2]], source)
    assert result.video.shape == (243, 32, 32, 3) and torch.equal(result.video[:141], torch.from_numpy(frames) / 255)
    assert spy.progress == [(1, 1)] and plan.forwards == 1  # window 0 is the source: not counted


@pytest.mark.slow  # two windows with their source encodes: 15-140 s on the shared 2-core host
def test_a_continuation_edit_gives_each_window_its_slice_of_the_source(tiny_pipeline, monkeypatch):
    """Issue 20 (a long video's remix): masks on the whole video's latent grid, each window's latents where the
    mask is 0 are exactly its own frames of the source, VAE-encoded; the audio is held on the global timeline."""
    from pathlib import Path

    from h3serve.model.conditioning import encode_audio_condition, encode_visual_condition
    from h3serve.model.pipeline_types import Conditioning
    from h3serve.rules.request import MediaRef

    pipeline, defaults = tiny_pipeline
    rng = np.random.default_rng(3)
    base = dict(prompt="a remix", width=32, height=32, steps=2, duration_s=8, long_video=True,
                long_video_mode="continuation", continuation_window_frames=107,
                source_video=MediaRef(Path("/s.mp4"), "s.mp4", "video"))
    lt = validate(GenerationRequest(**base, video_noise_mask=0.5), defaults).latent_frames
    kept = 36  # global latent frames [0, 36) keep the source (window 1's first 10 too); the rest is generated
    mask = np.ones((lt, 2, 2))
    mask[:kept] = 0
    plan = validate(GenerationRequest(**base, video_noise_mask=mask.tolist(), audio_noise_mask=0.0), defaults)
    frames = rng.integers(0, 255, (plan.num_frames, 32, 32, 3), dtype=np.uint8)
    wave = torch.from_numpy(rng.uniform(-0.5, 0.5, (2, round(plan.duration_s * 32_000))).astype(np.float32))
    spy = Spy(pipeline, monkeypatch, decode=False)
    video, audio = pipeline.generate(plan, Conditioning(edit_video=frames, edit_audio=wave))
    assert len(spy.windows) == 2
    offset, compared = 0, 0
    for record in spy.windows:
        window, (latents, _) = record["window"], record["latents"]
        offset -= window.overlap_latent_frames
        source = encode_visual_condition(
            pipeline.components.vae, torch.from_numpy(frames[window.start : window.end]).permute(3, 0, 1, 2)[None])
        keep = max(0, min(kept - offset, window.latent_frames))
        assert torch.equal(latents[:, :, :keep], source[:, :, :keep])
        assert not torch.equal(latents[:, :, keep:], source[:, :, keep:]) or keep == window.latent_frames
        compared += keep
        offset += window.latent_frames
    assert offset == lt and compared > kept  # the overlaps are compared in both windows
    rows = encode_audio_condition(pipeline.components.audio_vae, wave)
    clean = rows.reshape(2, -1, rows.shape[-1]).permute(0, 2, 1)[:, :, : plan.audio_latents]
    assert torch.equal(audio[:, :, : clean.shape[2]], clean)
