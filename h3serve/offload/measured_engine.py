"""The measured engine's conventions: where vLLM-Omni, the engine every published H3 memory figure was measured
on, holds memory that h3serve does not, as named terms with their sources.

`h3serve plan --as-engine vllm-omni` (`build_inventory(..., engine=VLLM_OMNI)`) plans a configuration as vLLM-Omni
runs it, so the planner can be checked against those figures (`tests/offload/test_planner_profiles.py`,
docs/memory.md, "Against every measured profile"). h3serve's own plans (the engine's start-up check, `auto`
resident layers, admission) never use these terms: they describe what h3serve itself does.

Sources: the vLLM-Omni wheels 0.26.0, 0.28.0 and 0.30.0 from PyPI, paths relative to `vllm_omni/diffusion/`. The
measurements were taken on 0.26.1 development builds (the RTX 4090 and 5090 recipes) and an unstated build (RTX
PRO 5000), all on GPUs (sm89, sm120) where the terms below hold in every one of those releases.

  vae_fp32           models/minimax_h3/vae.py, `MiniMaxH3VideoVAE.__init__`: `self.remote.eval().to(device,
                     dtype=torch.float32)` ("video VAE weights stay FP32 ... decode still runs under FP16 autocast").
                     0.28 and 0.30 then persist the decoder blocks' linears in fp16, but only where
                     `ops/vae/dispatch.py` finds its fused operators: sm90, sm100 and sm103, none of the measured
                     GPUs. So the whole video VAE is fp32 there: 9.70 GiB where h3serve holds 5.19 (fp32 encoder,
                     bf16 decoder). Counted by `inventory.build_inventory`.
  text encoder       models/minimax_h3/encoder.py, `MiniMaxH3Qwen3VLTextModel`: min(64, 50) decoder layers
                     (`MINIMAX_H3_QWEN3VL_SELECTED_LM_LAYER`; h3serve loads one more) and the token embedding sharded
                     over the encoder's TP ranks (`MiniMaxH3Qwen3VLVocabParallelEmbedding`; h3serve keeps it whole);
                     the vision tower replicated, as in h3serve. Counted by `inventory.text_encoder_bytes`.
  whole-video decode `MiniMaxH3VideoVAE.decode_latent` (0.26, 0.28) decodes the whole latent with the checkpoint's
                     `decode_base`, whose temporal loop "accumulates the whole decoded video in a floating-point
                     buffer" (0.30 vae_temporal.py, whose uint8 fork of it "shrinks [it] 4x": fp32), then reverts it
                     with the checkpoint processor's `revert_tensor`, which "materializes a denormalized copy, a
                     clamped copy, and a contiguous copy of the whole decoded video -- three pixel-scale tensors
                     resident at the decode peak" (0.30 vae.py, `_revert_decoded_inplace`): WHOLE_VIDEO_COPIES fp32
                     videos, on every rank of the tile group (the checkpoint's tile gather is an all-gather, 0.30
                     vae.py `_persistent_tile_gather`). Counted by `activations.whole_video_decode`.
  retained cache     PyTorch's caching allocator keeps freed blocks reserved and serves a request only from a cached
                     block at least as large. vLLM-Omni released nothing at the denoise -> decode boundary until 0.30
                     added `_release_stage_cache` (models/minimax_h3/pipeline_minimax_h3.py: it "lets a finished
                     stage's freed activations -- the DiT's denoise buffers, an encode input, a decoded frame tensor --
                     stay physically mapped across the next stage's peak"). Each whole-video buffer is larger than
                     any denoise block, so when nothing is loaded at that boundary (the VAE resident, not staged) the
                     denoise working set stays reserved through the decode peak (`retains_denoise_cache`). When the
                     VAE is staged, its weights are carved from those freed blocks instead.
  communicators      distributed/parallel_state.py, `initialize_model_parallel`: a sequence-parallel group beside the
                     Ulysses and Ring groups, so one NCCL communicator more than h3serve's layout when sequence
                     parallelism has one axis (`communicators`).
  Ulysses exchange   distributed/comm.py, `all_to_all_4D`: per exchanged tensor a transposed contiguous copy, the
                     receive buffer and the copy laid back; counted with h3serve's own (`ULYSSES_EXCHANGE`).
"""

from __future__ import annotations

from h3serve.parallel.degrees import ParallelDegrees
from h3serve.rules import limits

H3SERVE = "h3serve"
VLLM_OMNI = "vllm-omni"
ENGINES = (H3SERVE, VLLM_OMNI)

TEXT_ENCODER_LAYERS = limits.TEXT_ENCODER_LAYER  # vLLM-Omni keeps decoder layers 0..49 (hidden_states[50])
WHOLE_VIDEO_COPIES = 4  # the decoded fp32 video and revert_tensor's three pixel-scale copies of it
# The attention's extra [rows, heads/TP, Dh] tensors under Ulysses, beyond the six (q, k, v, two RoPE temporaries,
# the output) counted without it. h3serve (h3serve.parallel.sequence, ulysses.scatter_heads, comm.all_to_all): at
# the peak the caller's fused q|k|v and normalised q, k (5), their concatenation (3), the received exchange (3) and
# its re-laid-out copy (3): 14, 8 more. vLLM-Omni (minimax_h3_transformer.py, comm.py `all_to_all_4D`): the
# caller's 5, the exchanged q, k, v (3), the output (1) and the inverse exchange's contiguous copy, receive buffer
# and copy laid back (3): 12, 6 more.
ULYSSES_EXCHANGE = {H3SERVE: 8, VLLM_OMNI: 6}


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"--as-engine: unknown engine {engine!r}; choose from: {', '.join(ENGINES)}")
    return engine


def communicators(engine: str, degrees: ParallelDegrees, rank: int) -> tuple[str, ...]:
    """The process groups of more than one rank `rank` joins under `engine` (one NCCL communicator each)."""
    names = degrees.communicators(rank)
    if engine == VLLM_OMNI and degrees.sequence_parallel > 1 and "sp" not in names:
        names = (*names, "sp")
    return names


def retains_denoise_cache(engine: str, stage: str, vae_staged: bool) -> bool:
    """Whether `stage` holds the denoise working set's freed blocks reserved beside its own (see "retained cache")."""
    return engine == VLLM_OMNI and stage == "video_decode" and not vae_staged


# What the planner cannot model: measured / planned - 1 over every published measurement, each planned as its
# engine ran it (tests/offload/test_planner_profiles.py recomputes these from the pinned plans; docs/memory.md
# lists them). The rest is allocator fragmentation, kernel workspaces and per-build engine differences.
UNMODELLED = (-0.054, 0.092)
UNMODELLED_PROFILES = 12
