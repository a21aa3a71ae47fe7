"""What the spawned ranks run for the streamed-decode tests (importable by the spawned processes)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from offload_sessions import dlo
from rank_sessions import plan_for

from h3serve.config.engine_config import EngineConfig
from h3serve.config.offload_config import OffloadConfig
from h3serve.media.mp4 import EncoderOptions, write_mp4
from h3serve.media.sink import DiscardSink, Mp4Sink
from h3serve.model.pipeline_types import StageClock
from h3serve.model.stream_decode import decode_chunks
from h3serve.parallel.vae_tiles import TileParallelDecode
from h3serve.rank.model_runner import ModelRunner

FAST = EncoderOptions(preset="ultrafast", threads=1)
SMALL_TILES = (32, 32, 16, 16)  # 128x64 frames in 3x7 tiles: every clip's tiles are spread over the ranks
CASES = [
    ("tp2_tiles", {"tensor_parallel_size": 2, "vae_patch_parallel_size": 2}, OffloadConfig()),
    ("u2_tiles", {"ulysses_degree": 2, "vae_patch_parallel_size": 2}, OffloadConfig()),
    ("dlo_local_tp2_tiles", {"tensor_parallel_size": 2, "vae_patch_parallel_size": 2}, dlo("rank-local", 1)),
]


def _standalone_chunks(rank: int, checkpoint: Path) -> dict | None:
    """Tile-parallel streamed chunks against the VAE's own one-rank decode of the same latents."""
    from diffusers import AutoencoderKLMiniMaxH3

    vae = AutoencoderKLMiniMaxH3.from_pretrained(checkpoint / "vae").eval()
    vae.enable_tiling(*SMALL_TILES)
    z = torch.randn((1, 24, 12, 4, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = vae._decode(z) if rank == 0 else None  # before the install: the VAE's own methods
        TileParallelDecode.install(vae, dist.group.WORLD)
        pieces = list(decode_chunks(vae, z))
    if rank != 0:
        return {"pieces": len(pieces)}
    return {"streamed": torch.cat(pieces, dim=2), "reference": reference, "pieces": len(pieces)}


def _case(rank: int, world: int, checkpoint: Path, layout: dict, offload: OffloadConfig, folder: Path) -> dict:
    """One layout: the full decode written by `write_mp4` on rank 0, then its latents streamed into an
    `Mp4Sink` on rank 0 (a `DiscardSink` elsewhere), under the engine's placement hooks."""
    config = EngineConfig(model=checkpoint, threads=1, task_type="fl2va", num_ranks=world, offload=offload, **layout)
    engine = ModelRunner(config, rank, world)
    pipe = engine.pipeline
    pipe.components.vae.enable_tiling(*SMALL_TILES)
    plan = plan_for(engine.defaults)
    with torch.no_grad():
        full = pipe.generate(plan)  # --decode-mode full
    out: dict = {"video_frames": full.video.shape[0]}
    if rank == 0:
        write_mp4(folder / "full.mp4", full.video.numpy(), full.audio.numpy(), options=FAST)
        out["full"] = (folder / "full.mp4").read_bytes()
    # The soundtrack is the same `decode_audio` call either way (the slowest stage on one thread): reused.
    pipe.decoder.decode_audio = lambda latents: full.audio.clone()
    sink = Mp4Sink(folder / "streamed.mp4", FAST) if rank == 0 else DiscardSink()
    clock = StageClock(pipe.device, pipe.hooks)
    with torch.no_grad(), pipe.hooks.request(plan.task):
        streamed = pipe.decoder.decode(full.video_latents, full.audio_latents, clock, None, sink)
    out["streamed_frames"] = streamed.num_frames
    if rank == 0:
        out["streamed"] = (folder / "streamed.mp4").read_bytes()
    return out


def stream_cases(rank: int, world: int, checkpoint: Path) -> dict:
    out = {"standalone": _standalone_chunks(rank, checkpoint)}
    with tempfile.TemporaryDirectory() as folder:
        for name, layout, offload in CASES:
            out[name] = _case(rank, world, checkpoint, layout, offload, Path(folder))
    return out
