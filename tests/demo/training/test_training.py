"""The demo trainers: each one's loss falls over a few steps, the examples are laid out exactly as the pipeline
lays out a request (with inputs a person made too), and the shipped weights' recipe is `RUN15`'s (test_stages.py runs
`train-demo` itself)."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from h3serve.checkpoint.resolver import read_layout
from h3serve.demo.shipped import shipped_demo_checkpoint
from h3serve.demo.training.dit import (
    ANCHOR_WEIGHT,
    CLICK_WEIGHT,
    EMA,
    Phase,
    Replicas,
    batch_loss,
    draw_base,
    intra_op_threads,
    layout_groups,
    layout_key,
    train_dit,
    training_init_,
)
from h3serve.demo.training.examples import ExampleBuilder, render
from h3serve.demo.training.train import DEFAULT_RECIPE, RECIPES, RUN15, TRAINING_FILE, Recipe
from h3serve.demo.training.vaes import Canvas, audio_batch, train_audio_vae, train_video_vae
from h3serve.demo.world import scenes as world
from h3serve.demo.world.grammar import Attributes
from h3serve.loading.components import load_components
from h3serve.model.pipeline import H3Pipeline
from h3serve.model.pipeline_types import Conditioning
from h3serve.rules.long_video import plan_windows
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate
from h3serve.tools.tiny.make_checkpoint import build_tiny_checkpoint

pytestmark = pytest.mark.slow

ATTRS = Attributes("green", "square", "moving right", "low hum")


@pytest.fixture(scope="module")
def demo_random_path(tmp_path_factory):
    """The demo preset with random weights at seed 0, on disk: `train-demo`'s staging checkpoint."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("demo") / "random", seed=0, preset="demo")


@pytest.fixture(scope="module")
def demo_random(demo_random_path):
    """The demo preset with random weights, loaded: the trainers' starting point."""
    layout = read_layout(demo_random_path)
    return load_components(layout, lean_audio_decode=False), layout.defaults()  # as the trainer loads them


def falls(losses: list[float], k: int = 5) -> bool:
    return float(np.mean(losses[-k:])) < 0.8 * float(np.mean(losses[:k]))


def recorder():
    losses: list[float] = []
    return losses, lambda stage, step, loss: losses.append(loss)


def test_video_vae_loss_falls(demo_random):
    components, _ = demo_random
    losses, log = recorder()
    train_video_vae(components.vae, 16, Canvas(64, 32), seed=0, log=log)  # a quarter of the canvas: 7x faster
    assert len(losses) == 16 and falls(losses, 4), losses


def test_audio_vae_loss_falls(demo_random):
    """On a held-out batch: the training batches mix burst crops and the world's, so their losses are not alike."""
    audio_vae = demo_random[0].audio_vae
    held_out = audio_batch(np.random.default_rng(99), 4)

    def error() -> float:
        with torch.no_grad():
            decoded = audio_vae.decode(audio_vae.encode(held_out).latent_dist.mode()).sample
        return float((decoded - held_out).pow(2).mean())

    before = error()
    losses, log = recorder()
    train_audio_vae(audio_vae, 16, seed=0, log=log)
    assert len(losses) == 16 and error() < 0.8 * before, (before, error(), losses)


def is_burst_crop(crop: torch.Tensor) -> bool:
    """The click alone, in some (not all) of the crop's whole latents."""
    click = torch.from_numpy(world.click_wave(0)).float()
    latents = crop.reshape(-1, world.SAMPLES_PER_LATENT)
    on = [bool(latent.any()) for latent in latents]
    whole = all(torch.allclose(latent, click, atol=1e-6) for latent, lit in zip(latents, on, strict=True) if lit)
    return whole and 0 < sum(on) < len(on)


def test_audio_batches_start_on_the_latent_grid_with_burst_crops_first():
    crops = audio_batch(np.random.default_rng(0), 4, bursts=2)[:, 0]  # [4, 16000]
    assert [is_burst_crop(crop) for crop in crops] == [True, True, False, False]
    world_crops = crops[2:]
    assert world_crops.abs().amax(dim=1).min() > 0.1  # the world's tones
    assert world_crops[:, 0].abs().max() < 1e-6  # on the grid every tone (and click) is at phase 0
    assert all(is_burst_crop(crop) for crop in audio_batch(np.random.default_rng(1), 3, bursts=3)[:, 0])  # warm-up


def test_examples_are_the_pipelines_own_layout_and_the_dit_loss_falls(demo_random):
    components, defaults = demo_random
    builder = ExampleBuilder(components, 128, 64, defaults.reference_image_short_edge)
    clip = render(world.sample_scene(np.random.default_rng(0), "fl2va", 128, 64, 107, ATTRS))
    t2va, fl2va = builder.keyframes(clip, ()), builder.keyframes(clip, ("first", "last"))

    # The pipeline's own first stage on the same request: the same text states and the same packed rows.
    plan = validate(GenerationRequest(prompt=t2va.prompt, duration_s=4, steps=1, seed=0), defaults)
    encoded = H3Pipeline(components).encode(plan, Conditioning())
    assert torch.equal(encoded.text_states, t2va.text_states)
    for field in ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices"):
        assert torch.equal(getattr(encoded.layout.packed, field), getattr(t2va.layout.packed, field))
    assert t2va.video.shape == (32 * 2 * 4, 96) and t2va.audio.shape == (2 * 178, 32)
    assert fl2va.conditions.shape == (2 * 2 * 4, 96)  # two keyframes, one latent frame each
    assert fl2va.layout.num_video_condition_rows == 16
    # The first keyframe gives target frame 0: those rows are anchored (weighted in the loss, below; that the
    # trained VAE encodes both alike is tested on the shipped checkpoint).
    assert fl2va.anchored_rows == 8 and t2va.anchored_rows == 0
    assert builder.keyframes(clip, ("last",)).anchored_rows == 0
    # Keyframes as a person draws them, put on the canvas by the server's fit: the world's layout and targets, other
    # condition rows.
    drawn = builder.drawn_keyframes(clip, ("first", "last"), np.random.default_rng(0))
    assert layout_key(drawn) == layout_key(fl2va) and drawn.anchored_rows == 8
    assert torch.equal(drawn.video, fl2va.video) and not torch.equal(drawn.conditions, fl2va.conditions)

    bouncing = world.sample_scene(np.random.default_rng(2), "t2va", 128, 64, 277,
                                  Attributes("red", "ball", "bouncing", "high beep"))
    windows = builder.continuation(render(bouncing), 107)
    assert [e.kind for e in windows] == ["plain", "continuation", "continuation"]
    assert windows[1].conditions.shape[0] == 7 * 2 * 4  # the 22-frame guide: 7 latent frames
    assert torch.equal(windows[1].conditions, windows[0].video[-7 * 8 :])  # the previous window's last latents

    # A bounce's click rows: the clicks' audio latents in both channels, on each window's own rows.
    assert t2va.click_rows == () and fl2va.click_rows == ()  # moving right: no bounce
    window_plan = plan_windows(277, 107, 22)
    clicks = world.click_latents(bouncing, window_plan[-1].audio_end)
    assert len(clicks) >= 5
    found = set()
    for window, bounds in zip(windows, window_plan, strict=True):
        rows, latents = window.click_rows, bounds.audio_latents
        assert rows[: len(rows) // 2] == tuple(r - latents for r in rows[len(rows) // 2 :])  # both channels
        found |= {bounds.audio_start + r for r in rows[: len(rows) // 2]}
    assert sorted(found) == clicks
    short = builder.keyframes(render(dataclasses.replace(bouncing, frames=107)), ())
    assert short.click_rows == tuple(c + channel * 178 for channel in (0, 1) for c in clicks if c < 178)

    # Same prompt, same layout: one batch; keyframes change the layout.
    other = builder.keyframes(render(world.sample_scene(np.random.default_rng(5), "fl2va", 128, 64, 107, ATTRS)), ())
    groups = layout_groups([t2va, fl2va, other, windows[1]])
    assert [[id(e) for e in g] for g in groups] == [[id(t2va), id(other)], [id(fl2va)], [id(windows[1])]]

    # The training initialisation starts every block as the identity and the velocity at zero.
    dit = components.transformer_ref
    training_init_(dit)
    timestep, rows = t2va.layout.row_timesteps(0.5, 0.5)
    video, audio = dit(t2va.video[None], t2va.audio[None], dit.embed_text(t2va.text_states), timestep, rows,
                       t2va.layout.packed)
    assert not video.any() and not audio.any()

    # With a zero velocity the loss is the weighted target error: the anchored rows weigh ANCHOR_WEIGHT, the click
    # rows CLICK_WEIGHT (here two made-up ones on the first of a batch of two).
    clicked = dataclasses.replace(fl2va, click_rows=(3, 178 + 3))
    noise = torch.Generator().manual_seed(0)
    eps_video = torch.randn((2, *fl2va.video.shape), generator=noise)  # batch_loss's first two draws
    eps_audio = torch.randn((2, *fl2va.audio.shape), generator=noise)
    weight = torch.ones(fl2va.video.shape[0])
    weight[:8] = ANCHOR_WEIGHT
    audio_weight = torch.ones(2, fl2va.audio.shape[0])
    audio_weight[0, [3, 181]] = CLICK_WEIGHT
    expected = (weight / weight.mean() * (fl2va.video - eps_video).pow(2).mean(2)).mean() + (
        audio_weight / audio_weight.mean() * (fl2va.audio - eps_audio).pow(2).mean(2)).mean()
    loss = batch_loss(dit, [clicked, fl2va], torch.Generator().manual_seed(0), 0.5)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)

    losses, log = recorder()
    threads = torch.get_num_threads()
    phases = [Phase([t2va, other], 6, prior=True), Phase([t2va, other, fl2va, windows[0]], 18)]
    train_dit(dit, phases, seed=0, log=log, name="t", batch=2, lr=3e-3, replicas=2, warmup=4)
    assert len(losses) == 24 and falls(losses, 6), losses
    assert not dit.training and not any(p.requires_grad for p in dit.parameters())
    assert torch.get_num_threads() == threads  # the replicas' one intra-op thread is given back


def test_replicas_leave_the_batch_gradient_of_their_shards(demo_random):
    """Three examples over two replicas on threads: shards of two and one, each shard's loss weighted by its share,
    and the gradients left in the DiT are those of the weighted sum computed on one thread (bit for bit but where
    autograd sums a parameter's contributions in another order); `sync` then gives the copy the DiT's weights."""
    components, defaults = demo_random
    builder = ExampleBuilder(components, 128, 64, defaults.reference_image_short_edge)
    items = [builder.keyframes(render(world.sample_scene(np.random.default_rng(seed), "t2va", 128, 64, 107, ATTRS)),
                               ()) for seed in range(3)]
    dit = copy.deepcopy(components.transformer).train().requires_grad_(True)
    expected = copy.deepcopy(dit)
    with intra_op_threads(1):
        parallel = Replicas(dit, 2, seed=7)
        loss = parallel.loss_backward(items, 0.6)
        first = batch_loss(expected, items[:2], torch.Generator().manual_seed(7), 0.6)
        second = batch_loss(expected, items[2:], torch.Generator().manual_seed(10_007), 0.6)
        (first * (2 / 3) + second * (1 / 3)).backward()
        parallel.close()
    assert loss == pytest.approx(float(first) * 2 / 3 + float(second) / 3, rel=1e-6)
    copy_ = parallel.modules[1]
    assert all(p.grad is None for p in copy_.parameters())
    pairs = list(zip(dit.named_parameters(), expected.parameters(), strict=True))
    close = [torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-8) for (_, p), q in pairs]
    assert all(close), [name for ((name, _), _), ok in zip(pairs, close, strict=True) if not ok]
    assert sum(torch.equal(p.grad, q.grad) for (_, p), q in pairs) >= 0.9 * len(pairs)  # most bit for bit
    with torch.no_grad():
        for param in dit.parameters():
            param.add_(param.grad)
    parallel.sync()
    assert all(torch.equal(p, q) for p, q in zip(dit.parameters(), copy_.parameters(), strict=True))


def test_ema_and_the_base_position_draw():
    module = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        module.weight.zero_()
    ema = EMA(module, decay=0.5)
    with torch.no_grad():
        module.weight.fill_(1.0)
    ema.update(module, step=100)  # decay 0.5: halfway to the new weights
    ema.copy_to(module)
    assert torch.equal(module.weight, torch.full((2, 2), 0.5))
    bases = np.array([draw_base(np.random.default_rng(seed)) for seed in range(2000)])
    assert bases.min() >= 0.0 and bases.max() <= 1.0
    assert 0.3 < np.mean(bases >= 0.9) < 0.45  # the top tenth gets its uniform share plus HIGH_NOISE_SHARE
    prior = np.array([draw_base(np.random.default_rng(seed), prior=True) for seed in range(200)])
    assert prior.min() >= 0.8 and prior.max() <= 1.0 and prior.std() > 0.04


def test_the_shipped_weights_were_trained_by_run15s_recipe():
    """`h3serve train-demo --recipe run15` is the command that made the shipped weights (the same bits on the CPU
    that trained them; a run that rounds differently is another draw, docs/demo_lab_notebook.md, run 11): the recipe
    recorded beside them is `RUN15`'s, whose later fields change nothing (no drawn inputs; one stage per DiT, and
    the cut does not change the weights), and CI's few-step recipes scale the counts only."""
    demo = shipped_demo_checkpoint()
    assert demo is not None
    record = json.loads((demo / TRAINING_FILE).read_text(encoding="utf-8"))
    run15 = dataclasses.asdict(RUN15)
    assert record["recipe"] == {key: run15[key] for key in record["recipe"]}
    assert set(run15) - set(record["recipe"]) == {"drawn_share", "dit_stage_steps"} and RUN15.drawn_share == 0
    assert RECIPES["run15"] is RUN15 and RECIPES[DEFAULT_RECIPE] == Recipe()
    few = Recipe().scaled(0.01)
    assert (few.dit_steps, few.ref_dit_steps, few.seed, few.dit_replicas) == (186, 69, 0, 2)
    assert (few.dit_lr, few.ref_lr, few.drawn_share) == (Recipe().dit_lr, Recipe().ref_lr, Recipe().drawn_share)


def test_guide_examples_are_a_guided_requests_own_layout(demo_random, tmp_path, monkeypatch):
    """A guide example (a mid-clip frame counted from the end, with a sound that switches the pitch there) is laid
    out as the same request through the server's path (its files written, planned, decoded and encoded): the same
    packed rows, the same picture rows, the sound's rows to within its 16-bit WAV. (Both read the same
    presentation; the text encoder answers zeros here, its states are not at stake.)"""
    import wave

    from h3serve.engine.planning import plan_request
    from h3serve.model.conditioning import encode_audio_condition
    from h3serve.rank.media_conditioning import load_conditioning
    from h3serve.rules.request import MediaRef, TimelineGuide

    components, defaults = demo_random
    read = []

    def encode(ids, vision=None, key=None):
        read.append(ids)
        return torch.zeros(1, len(ids), 8)

    monkeypatch.setattr(components.text, "encode", encode)
    builder = ExampleBuilder(components, 128, 64, defaults.reference_image_short_edge)
    clip = render(world.sample_scene(np.random.default_rng(3), "fl2va", 128, 64, 107, ATTRS))
    example = builder.guides(clip, -40, switch_sound=True)  # frame 67
    assert example.kind == "guides" and example.conditions.shape == (2 * 4, 96)
    audio_latents = (3 * 178 - 5 * 67) // 3
    assert example.audio_references.shape == (2 * audio_latents, 32)
    unswitched = encode_audio_condition(components.audio_vae, torch.from_numpy(clip.wave))
    assert torch.equal(example.audio[:40], unswitched[:40]) and not torch.equal(example.audio, unswitched)

    picture = tmp_path / "frame.png"
    from PIL import Image

    Image.fromarray(clip.frames[67]).save(picture)
    cut = round(67 * 32_000 / 24)
    other = dataclasses.replace(clip.scene, attrs=dataclasses.replace(ATTRS, sound="high beep"))
    sound = world.render_audio(other, clip.wave.shape[1])[:, cut:]
    with wave.open(str(tmp_path / "sound.wav"), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(32_000)
        w.writeframes(np.round(sound.T * 32767).astype("<i2").tobytes())
    guide = TimelineGuide(-40, MediaRef(picture, "frame.png", "image"),
                          MediaRef(tmp_path / "sound.wav", "sound.wav", "audio"))
    request = GenerationRequest(prompt=example.prompt, duration_s=4, steps=1, seed=0, guides=(guide,))
    plan = plan_request(request, defaults)
    encoded = H3Pipeline(components).encode(plan, load_conditioning(plan, defaults))
    assert read[0] == read[1]  # the same presentation (guides never reach the text encoder)
    for field in ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices"):
        assert torch.equal(getattr(encoded.layout.packed, field), getattr(example.layout.packed, field))
    assert torch.equal(encoded.visual[0].flatten(), example.conditions.reshape(1, 2, 4, 24, 2, 2).permute(
        0, 3, 1, 4, 2, 5).flatten())
    assert (encoded.audio_rows[0] - example.audio_references).abs().max() < 0.05
