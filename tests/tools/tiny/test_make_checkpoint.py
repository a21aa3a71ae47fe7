"""Tests for the deterministic random-weight MiniMax-H3 checkpoint builder."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import ModularPipeline

from h3serve.model.transformer import H3TransformerConfig
from h3serve.tools.tiny import make_checkpoint as tc
from h3serve.tools.tiny import random_init as tiny_weights
from h3serve.tools.tiny.make_checkpoint import (
    PRESETS,
    build_tiny_checkpoint,
    default_checkpoint_dir,
    ensure_tiny_checkpoint,
    load_processor,
)
from h3serve.tools.tiny.presets import VAE_CONFIG

COMPONENTS = (
    "audio_scheduler",
    "audio_vae",
    "processor",
    "scheduler",
    "text_encoder",
    "tokenizer",
    "transformer",
    "transformer_ref",
    "vae",
)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _json(root: Path, name: str) -> dict:
    return json.loads((root / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


@pytest.fixture(scope="module")
def moved_checkpoint(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkpoint that was then renamed, so no file was written at its final location."""
    staging = tmp_path_factory.mktemp("staging") / "ckpt"
    shutil.copytree(checkpoint, staging)
    moved = tmp_path_factory.mktemp("elsewhere") / "moved-ckpt"
    staging.rename(moved)
    return moved


def test_layout_and_index(checkpoint: Path) -> None:
    index = _json(checkpoint, "modular_model_index.json")
    assert index["_class_name"] == "MiniMaxH3ModularPipeline"
    assert index["_blocks_class_name"] == "MiniMaxH3Blocks"
    for name in COMPONENTS:
        _library, _class_name, loading = index[name]
        assert loading["pretrained_model_name_or_path"] is None
        assert loading["subfolder"] == name
        assert (checkpoint / name).is_dir()
    assert index["processor"][:2] == ["transformers", "Qwen3VLProcessor"]
    assert index["transformer_ref"][:2] == ["diffusers", "MiniMaxH3Transformer3DModel"]


def test_no_absolute_paths_in_files(checkpoint: Path) -> None:
    needles = (str(checkpoint).encode(), str(checkpoint.parent).encode())
    for name, data in _files(checkpoint).items():
        assert not any(needle in data for needle in needles), name


def test_config_values(checkpoint: Path) -> None:
    index = _json(checkpoint, "modular_model_index.json")
    assert (index["canvas_short_edge"], index["canvas_max_pixels"]) == (64, 64 * 128)
    assert index["reference_image_short_edge"] == 64
    assert _json(checkpoint, "scheduler/scheduler_config.json")["shift"] == 12.0
    assert _json(checkpoint, "audio_scheduler/scheduler_config.json")["shift"] == 3.0
    text = _json(checkpoint, "text_encoder/config.json")
    assert text["text_config"]["num_hidden_layers"] > 50
    assert text["text_config"]["hidden_size"] == _json(checkpoint, "transformer/config.json")["text_dim"]
    audio_vae = _json(checkpoint, "audio_vae/config.json")
    assert len(audio_vae["latents_mean"]) == len(audio_vae["latents_std"]) == 32
    vae = _json(checkpoint, "vae/config.json")
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == 24
    assert min(vae["latents_std"] + audio_vae["latents_std"]) > 0
    assert _json(checkpoint, "transformer/config.json") == _json(checkpoint, "transformer_ref/config.json")


def test_presets() -> None:
    assert set(PRESETS) == {"tiny", "cpu-bench", "gpu-accept", "demo"}
    # gpu-accept: the released DiT's width (every field but the block counts and the tiny text stack's width)
    released = H3TransformerConfig()
    gpu = PRESETS["gpu-accept"].transformer
    differ = {k for k, v in gpu.items() if getattr(released, k) != v}
    assert differ == {"num_layers", "num_refiner_layers", "text_dim"} and gpu["num_layers"] == 2
    assert PRESETS["gpu-accept"].dit_dtype == "bfloat16" and PRESETS["tiny"].dit_dtype == "float32"
    bench = PRESETS["cpu-bench"]
    assert (bench.canvas_short_edge, bench.canvas_max_pixels, bench.reference_image_short_edge) == (
        256,
        448 * 256,
        256,
    )
    assert bench.transformer["hidden_size"] == 512 and bench.transformer["num_layers"] == 4
    for preset in PRESETS.values():
        assert preset.transformer["attention_head_dim"] >= 6 * preset.transformer["rope_freq_dim"]
    # demo: its own (trainable) VAE sizes; the others share the tiny random ones
    assert PRESETS["demo"].vae_config["decoder_num_layers"] == 3 and PRESETS["tiny"].vae_config is VAE_CONFIG


def test_size(checkpoint: Path) -> None:
    assert sum(len(data) for data in _files(checkpoint).values()) < 10 * 2**20


def test_same_seed_is_byte_identical(checkpoint: Path, tmp_path: Path) -> None:
    torch.manual_seed(12345)  # the build must not depend on the global RNG...
    state = torch.random.get_rng_state()
    rebuilt = build_tiny_checkpoint(tmp_path / "again", seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # ...nor consume it
    assert _files(rebuilt) == _files(checkpoint)


def test_other_seed_differs(checkpoint: Path, tmp_path: Path) -> None:
    other = build_tiny_checkpoint(tmp_path / "seed1", seed=1)
    first, second = _files(checkpoint), _files(other)
    assert first.keys() == second.keys()
    weights = [name for name in first if name.endswith(".safetensors")]
    assert len(weights) == 5
    assert all(first[name] != second[name] for name in weights)
    ref = "transformer_ref/diffusion_pytorch_model.safetensors"
    assert first["transformer/diffusion_pytorch_model.safetensors"] != first[ref]


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        build_tiny_checkpoint(tmp_path / "x", preset="huge")
    with pytest.raises(ValueError, match="seed"):
        default_checkpoint_dir(seed=-1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_checkpoint(tmp_path / "full")


def test_default_checkpoint_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("H3SERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_checkpoint_dir() == tmp_path / "home/.cache/h3serve/checkpoints/tiny-seed0"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_checkpoint_dir("cpu-bench", 3) == tmp_path / "xdg/h3serve/checkpoints/cpu-bench-seed3"
    monkeypatch.setenv("H3SERVE_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_checkpoint_dir() == tmp_path / "explicit/checkpoints/tiny-seed0"


def test_ensure_builds_once_under_a_race(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("H3SERVE_CACHE_DIR", str(tmp_path / "cache"))
    builds = []
    real_build = tc.build_tiny_checkpoint

    def counting_build(*args: object, **kwargs: object) -> Path:
        builds.append(1)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(tc, "build_tiny_checkpoint", counting_build)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_tiny_checkpoint())) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    target = default_checkpoint_dir()
    assert results == [target, target] and len(builds) == 1
    assert _files(target) == _files(checkpoint)
    assert ensure_tiny_checkpoint() == target and len(builds) == 1
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".tmp")]


def test_ensure_replaces_an_incomplete_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("H3SERVE_CACHE_DIR", str(tmp_path / "cache"))
    target = default_checkpoint_dir()
    target.mkdir(parents=True)
    (target / "leftover").write_text("partial build")
    assert ensure_tiny_checkpoint() == target
    assert not (target / "leftover").exists()
    assert tc.is_complete_checkpoint(target)


def test_load_processor_without_torchvision(checkpoint: Path) -> None:
    processor = load_processor(checkpoint)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert processor.image_processor.patch_size == 16 and processor.image_processor.merge_size == 2
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    text = _json(checkpoint, "text_encoder/config.json")
    assert processor.image_token_id == text["image_token_id"]
    assert processor.video_token_id == text["video_token_id"]
    assert processor.vision_start_token_id == text["vision_start_token_id"]
    ids = [processor.image_token_id, processor.video_token_id, 65]
    assert processor.create_mm_token_type_ids([ids]) == [[1, 2, 0]]


def _load_moved(moved: Path) -> ModularPipeline:
    pipe = ModularPipeline.from_pretrained(str(moved))
    pipe.load_components(dtype=torch.float32)
    return pipe


def test_loads_in_diffusers_after_moving(moved_checkpoint: Path) -> None:
    pipe = _load_moved(moved_checkpoint)
    assert type(pipe).__name__ == "MiniMaxH3ModularPipeline"
    for name in COMPONENTS:
        spec = pipe.get_component_spec(name)
        assert Path(spec.pretrained_model_name_or_path) == moved_checkpoint and spec.subfolder == name
        if name != "processor":  # Qwen3VLProcessor.from_pretrained needs torchvision
            assert getattr(pipe, name) is not None, name
    assert pipe.scheduler.config.shift == 12.0 and pipe.audio_scheduler.config.shift == 3.0
    assert pipe.config.canvas_short_edge == 64 and pipe.config.canvas_max_pixels == 64 * 128
    assert pipe.config.reference_image_short_edge == 64
    assert pipe.transformer.config == pipe.transformer_ref.config
    assert not torch.equal(pipe.transformer.proj_in.weight, pipe.transformer_ref.proj_in.weight)


def test_t2va_runs_in_diffusers_after_moving(moved_checkpoint: Path) -> None:
    pipe = _load_moved(moved_checkpoint)
    pipe.update_components(processor=load_processor(moved_checkpoint))
    out = pipe(
        prompt="A red fox trots through fresh snow.",
        num_frames=124,
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        output=["videos", "audio"],
    )
    videos, audio = np.asarray(out["videos"]), out["audio"]
    assert videos.shape == (1, 124, 64, 128, 3)  # 16:9 default canvas at short edge 64
    assert tuple(audio.shape) == (1, 2, 207 * 800)
    assert np.isfinite(videos).all() and torch.isfinite(audio).all()
    assert 0.01 < float(videos.std()) and 0.01 < float(audio.std())
    assert float((audio.abs() == 1).float().mean()) < 0.2  # the random audio decoder is mostly unclamped


def test_large_tensors_are_drawn_in_chunks_with_bits_independent_of_the_thread_count(monkeypatch) -> None:
    """The released width's tensors (gpu-accept) are drawn on every core; the bits depend on the seed alone, the
    values keep the fan-in scale and a constant's offset, and a tensor at the threshold is drawn as before."""
    monkeypatch.setattr(tiny_weights, "CHUNKED_DRAW_ELEMENTS", 3000)
    monkeypatch.setattr(tiny_weights, "DRAW_CHUNK_ELEMENTS", 1000)
    weight = torch.nn.Parameter(torch.empty(64, 100))
    ones = torch.nn.Parameter(torch.ones(5000))
    draws = []
    for threads in (1, 3):
        monkeypatch.setattr(tiny_weights.os, "cpu_count", lambda threads=threads: threads)
        generator = torch.Generator().manual_seed(0)
        draws.append((tiny_weights._draw_like(weight, generator), tiny_weights._draw_like(ones, generator)))
    (w1, o1), (w3, o3) = draws
    assert torch.equal(w1, w3) and torch.equal(o1, o3) and w1.dtype == torch.float32
    assert abs(float(w1.std()) * 10 - 1) < 0.05  # N(0, 1/fan_in), fan_in 100
    assert abs(float(o1.mean()) - 1) < 0.01 and abs(float(o1.std()) - 0.1) < 0.01
    assert not torch.equal(w1[:10], w1[10:20])  # chunks are not repeats of one another
    small = torch.nn.Parameter(torch.empty(30, 100))  # 3000 elements: the one-generator draw, bit for bit
    expected = torch.randn(30, 100, generator=torch.Generator().manual_seed(1), dtype=torch.float64) / 10
    assert torch.equal(tiny_weights._draw_like(small, torch.Generator().manual_seed(1)), expected)
