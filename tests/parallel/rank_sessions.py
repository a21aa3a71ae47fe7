"""What the spawned ranks run for the multi-rank tests (importable by the spawned processes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from rank_plans import PROMPT, plan_for

from h3serve.config.engine_config import EngineConfig
from h3serve.config.offload_config import OffloadConfig
from h3serve.demo.evaluation import DemoEvaluator
from h3serve.demo.shipped import DEMO_PROMPT
from h3serve.model.pipeline_types import LatentTarget, StageClock
from h3serve.parallel.setup import parameter_bytes
from h3serve.parallel.vae_tiles import TileParallelDecode
from h3serve.rank.media_conditioning import load_conditioning
from h3serve.rank.model_runner import ModelRunner
from h3serve.rules.validate import GenerationPlan


def packed_length(plan: GenerationPlan) -> int:
    video_rows = plan.latent_frames * (plan.latent_height // 2) * (plan.latent_width // 2)
    return len(PROMPT.encode()) + 2 * plan.audio_latents + video_rows


def _config(checkpoint: Path, **overrides) -> EngineConfig:
    return EngineConfig(model=checkpoint, threads=1, task_type="fl2va", **overrides)


def _summary(engine: ModelRunner, keep_video: bool, several: bool = False) -> dict:
    result = engine.pipeline.generate(plan_for(engine.defaults))
    if several:  # seeds 1 and 2 as one DiT batch (num_outputs_per_prompt 2): the batch through this layout
        batch = engine.pipeline.generate(dataclasses.replace(plan_for(engine.defaults), num_outputs=2))
        several_latents = [(r.video_latents, r.audio_latents) for r in (batch, *batch.others)]
    text = engine.pipeline.components.text.model
    parallel = engine.parallel
    return {
        # (tp, ulysses, ring, text-encoder tp, vae tiles) as installed on this rank
        "applied": (
            parallel.dit_tp.size if parallel and parallel.dit_tp else 1,
            parallel.sequence.ulysses if parallel and parallel.sequence else 1,
            parallel.sequence.ring if parallel and parallel.sequence else 1,
            parallel.text_tp.size if parallel and parallel.text_tp else 1,
            bool(parallel and parallel.vae_group is not None),
        ),
        "video_latents": result.video_latents,
        "audio_latents": result.audio_latents,
        "video": result.video if keep_video else None,
        "dit_bytes": parameter_bytes(engine.pipeline.components.transformer),
        "text_bytes": sum(p.numel() * p.element_size() for p in text.parameters() if not p.is_meta),
        "several": several_latents if several else None,
        "cached_steps": None if result.block_cache is None else result.block_cache.cached_steps,
    }


def guided_latents(engine: ModelRunner, plan: GenerationPlan) -> dict:
    """A plan with timeline guides on this engine, its media decoded on this rank: the target latents (no decode)."""
    pipeline = engine.pipeline
    clock = StageClock(torch.device("cpu"))
    enc = pipeline.encode(plan, load_conditioning(plan, engine.defaults), clock)
    video, audio = pipeline.sampler.sample(plan, enc, pipeline.components.transformer, LatentTarget.of(plan), plan.seed,
                                           clock, None)
    return {"video_latents": video, "audio_latents": audio, "condition_rows": enc.layout.num_video_condition_rows,
            "audio_condition_rows": enc.layout.num_audio_reference_rows}


def pipeline_cases(
    rank: int, world: int, checkpoint: Path, cases: list[tuple[str, dict]], tile_decodes: bool = False,
    several: bool = False, guided: GenerationPlan | None = None, guided_cases: tuple[str, ...] = (),
) -> dict:
    """Rank 0 first runs the one-rank reference (same thread count), then every rank runs each layout
    (and, with `tile_decodes`, the standalone VAE tile-parallel decodes; with `several`, each layout also runs
    two outputs as one batch; the `guided` plan (timeline guides) on one rank and in the `guided_cases` layouts)."""
    out = {}
    if tile_decodes:
        out["tile_decodes"] = vae_tile_decodes(rank, world, checkpoint)
    if rank == 0:  # the other ranks wait for it in the next case's first collective
        engine = ModelRunner(_config(checkpoint), 0, 1)
        out["reference"] = _summary(engine, keep_video=True)
        if guided is not None:
            out["reference"]["guided"] = guided_latents(engine, guided)
        for name, overrides in cases:  # a cached layout's one-rank twin: the same cache on every row
            if "cache_backend" in overrides:
                twin = {k: v for k, v in overrides.items() if k.startswith("cache_")}
                out[f"{name}:one_rank"] = _summary(ModelRunner(_config(checkpoint, **twin), 0, 1), keep_video=False)
    for name, overrides in cases:
        engine = ModelRunner(_config(checkpoint, num_ranks=world, **overrides), rank, world)
        out[name] = _summary(engine, keep_video=name.startswith("vae"), several=several)
        if guided is not None and name in guided_cases:
            out[name]["guided"] = guided_latents(engine, guided)
        del engine
    return out


def vae_tile_decodes(rank: int, world: int, checkpoint: Path) -> list[dict] | None:
    """Tile-parallel decode against the VAE's own one-rank tiled decode, on the same latents."""
    from diffusers import AutoencoderKLMiniMaxH3

    vae = AutoencoderKLMiniMaxH3.from_pretrained(checkpoint / "vae").eval()
    parallel = TileParallelDecode(vae, dist.group.WORLD)
    cases = [
        ((1, 24, 12, 4, 8), (32, 32, 16, 16)),  # 2 temporal chunks x 3x7 spatial tiles: 42 units over the ranks
        ((1, 24, 7, 4, 8), (256, 256, 64, 64)),  # the default tiles: one chunk, one tile, so rank 1 owns none
    ]
    out = []
    for shape, tiling in cases:
        vae.enable_tiling(*tiling)
        z = torch.randn(shape, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            mine = parallel(z)
            reference = type(vae)._decode(vae, z) if rank == 0 else None
        out.append({"parallel": mine, "reference": reference})
    return out if rank == 0 else None


def fp8_cases(rank: int, world: int, checkpoint: Path, cases: list[tuple[str, dict]], quantization) -> dict:
    """Rank 0 first runs the one-rank FP8 reference, then every rank runs each layout: latents and how many
    FP8 layers this rank's DiT holds."""
    from h3serve.accel.fp8 import Fp8Linear

    def summary(engine: ModelRunner) -> dict:
        result = engine.pipeline.generate(plan_for(engine.defaults))
        layers = sum(isinstance(m, Fp8Linear) for m in engine.pipeline.components.transformer.modules())
        return {"video_latents": result.video_latents, "audio_latents": result.audio_latents, "fp8_layers": layers}

    out = {}
    if rank == 0:
        out["reference"] = summary(ModelRunner(_config(checkpoint, quantization=quantization), 0, 1))
    for name, overrides in cases:
        out[name] = summary(ModelRunner(_config(checkpoint, num_ranks=world, **overrides), rank, world))
    return out


def demo_cases(rank: int, world: int, checkpoint: Path, cases: list[tuple[str, dict]]) -> dict:
    """`make demo`'s request on the trained demo checkpoint (h3serve.demo.shipped), its decoded video and
    soundtrack: rank 0 first on one rank and then with its DiT streamed layer by layer (layerwise offload), then every
    rank through each layout."""

    def run(engine: ModelRunner) -> dict:
        evaluator = DemoEvaluator(engine.pipeline, engine.defaults)
        result = engine.pipeline.generate(evaluator.plan(DEMO_PROMPT, 0))
        return {"video": result.video.numpy(), "audio": result.audio.numpy()}

    out = {}
    if rank == 0:
        out["reference"] = run(ModelRunner(EngineConfig(model=checkpoint, threads=1), 0, 1))
        layerwise = EngineConfig(model=checkpoint, threads=1, offload=OffloadConfig(streamed=frozenset({"dit"})))
        out["layerwise"] = run(ModelRunner(layerwise, 0, 1))
    for name, overrides in cases:
        config = EngineConfig(model=checkpoint, threads=1, num_ranks=world, **overrides)
        out[name] = run(ModelRunner(config, rank, world))
    return out
