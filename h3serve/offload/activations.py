"""Activation estimates per stage: stated formulas over the request shape, not measurements.

Bytes are for one rank. `es` is the compute dtype's element size (2 for bf16). Rows S of the packed sequence:
  S = L (text + vision-block tokens) + condition rows + 2·A (stereo audio latents) + F·(H/32)·(W/32) (video),
with F = 5n+2 latent frames for 17n+5 frames and A = round(frames/24·40).

denoise, inside one DiT block (`TransformerBlock.forward`) for this rank's S_l = ceil(S/(ulysses·ring)) rows:
  6 AdaLN tables [S_l, D] (gathered whole, alive for the whole block) + residual x + modulated input h
  + max(attention: q, k, v, two RoPE temporaries and the output, each [S_l, heads/TP·Dh] (with Ulysses the
        exchange's buffers, measured_engine.ULYSSES_EXCHANGE more of them: 8 for h3serve, 6 for vLLM-Omni; with
        Ring also the k/v block in flight and its receive slot, 4 more, and the fp32 output accumulator, merge and
        partial);
        FFN: fused [value; gate] output 2·ffn/TP, silu(gate) ffn/TP, the product ffn/TP);
  with video sparse attention (`vsa`, FASTVIDEO_VSA) also its tile buffers (`vsa_buffers`);
  in row chunks (`--denoise-chunk-rows`, the planner's `denoise_chunk_rows`) only the residual stream in and out,
  q, k, v and the attention output are whole, the rest per chunk (`chunked_block`);
  after the blocks (heads run on every row): the gathered [S, D] stream, the selected rows, their norm and
  modulation (4·S·D); plus fp32 RoPE cos/sin [S_l, 6·Fr] and four fp32 copies of the video/audio rows (noise,
  velocity, the sampler's update, the condition rows).
text_encode (ranks running the encoder): the 52 retained hidden states [L, hidden] (output_hidden_states)
  + one layer's working set: q, k, v, o and 3·intermediate/TP (gate, up, their product). Other ranks: the
  broadcast [L, hidden] states.
vae_encode: the tiled causal-CNN encoder on one 256-px tile at fp32 (the encoder is fp32): 8 feature maps of
  block_out_channels[0]·tile² + the normalised keyframes [3, H, W] fp32 (twice: input and its copy); an edit's or
  extension's source video goes one 17-frame VAE clip at a time (uint8 and two fp32 copies of the clip, the
  feature maps for each of its frames) beside the whole video's moments.
video_decode (the rank that stitches: rank 0, or every rank without VAE patch parallel): every decoded tile
  of every temporal chunk (units of [3, 28, tile, tile] kept until stitching, `vae_tiles`) + the stitched
  video twice (chunks and their concatenation) in es, or the pipeline's fp32 post-processing (the video in es
  plus two fp32 copies [T, H, W, 3]), whichever is larger; plus one tile's decoder working set (fp32 residual
  stream, 8·width + 3·ffn per token). Ranks that only decode their share hold their own units twice (the
  gather's send buffer). Streamed (`--decode-mode stream`, the default) only one temporal clip is alive: on one
  rank one tile at a time (the decoder's output and its unpatchified copy) stitched in place into the clip
  [3, 28, H, W] in es (h3serve.model.tile_stitch), with patch parallel the clip's gathered tiles; the previous
  clip's 5-frame tail in es; one frame's fp32 post-processing (two temporaries) before it leaves as uint8; the
  other ranks hold one clip's share of units twice.
  As vLLM-Omni decodes (`whole_video_decode`, measured_engine "whole-video decode"): the whole video in fp32 and
  revert_tensor's three pixel-scale copies of it on every rank, or while the clips decode the fp32 video and one
  clip's gathered tiles (its own and the gathered ones, fp16 under autocast), whichever is larger; plus the tile's
  decoder working set.
audio_decode: BigVGAN's widest stage: 12,800·A samples·channels per channel pair after the ×2 anti-alias
  upsample, stereo as batch 2, fp32, eight such maps alive (three AMP branches, their sum, Snake temporaries).
  Both decode modes decode the soundtrack in windows (h3serve.model.audio_windows): A is one window's
  latents, WINDOW_LATENTS + 2·RELEASED_AUDIO_HALO + 15 (the far end moved out by A mod 16), or A itself up to
  2·WINDOW_LATENTS (decoded whole); the whole [2, 800·A] fp32 output is counted besides.
The runtime overhead (context, NCCL, compile, allocator reserve, a retained stage cache) is
h3serve.offload.overhead's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from h3serve.model.audio_windows import ALIGNMENT, WINDOW_LATENTS
from h3serve.model.transformer import H3TransformerConfig
from h3serve.offload.inventory import Inventory, TextShape, VaeShape
from h3serve.offload.measured_engine import H3SERVE, ULYSSES_EXCHANGE, VLLM_OMNI, WHOLE_VIDEO_COPIES
from h3serve.parallel.degrees import ParallelDegrees
from h3serve.rules import geometry, limits

HIDDEN_STATES_KEPT = limits.TEXT_ENCODER_LAYER + 2  # embeddings + 51 layer outputs
VAE_CLIP_LATENTS = 7  # one temporal decode chunk: 5 latents + 2 overlap -> 28 frames
VAE_TEMPORAL_RATIO = 4
VAE_FRAME_OVERLAP = 5  # a clip's tail frames, kept to cross-fade into the next clip
AUDIO_WIDEST = 12_800  # samples·channels per latent at BigVGAN's widest (anti-aliased) stage
RELEASED_AUDIO_HALO = 48  # halo_latents() of the released audio VAE (checked on the meta device by a test)
VISION_MERGE = 32  # Qwen3-VL: 16-px patches merged 2x2 -> one token per 32x32 pixels
PRESENTATION_TOKENS = 8  # "<Picture k>: " label and the vision start/end tokens


@dataclass(frozen=True)
class RequestShape:
    """The request a plan is sized for. `condition_images`: keyframes (FL2VA) or reference images (Ref2VA),
    each at the canvas size; None picks 2 for fl2va, 1 for ref2va and 0 for t2va."""

    width: int
    height: int
    num_frames: int  # 17n + 5
    task: str = "t2va"
    prompt_tokens: int = 256
    condition_images: int | None = None
    steps: int = limits.DEFAULT_STEPS  # denoiser forwards: sizes the AdaLN modulations
    streamed_decode: bool = True  # --decode-mode stream: the VAE decodes one temporal clip at a time
    source_frames: int = 0  # an edit's or extension's source video at the canvas size, VAE-encoded by clips
    batch: int = 1  # items denoised together (several outputs of one prompt): the denoise activations grow with it
    control_channels: int = 0  # a ControlNet request's media: 3 per control or source video, 1 for a mask

    @property
    def images(self) -> int:
        if self.condition_images is not None:
            return self.condition_images
        return {"t2va": 0, "fl2va": 2, "ref2va": 1}[self.task]

    @property
    def latent_frames(self) -> int:
        return geometry.latent_frames(self.num_frames)

    @property
    def control_media_bytes(self) -> int:
        """Host bytes of a ControlNet request's media: float32 on the canvas for every frame, plus the one source
        frame being decoded and resized (at most the pixel budget's frame, as uint8 and float32)."""
        if not self.control_channels:
            return 0
        canvas = self.control_channels * self.num_frames * self.height * self.width * 4
        return canvas + limits.MEDIA_MAX_FRAME_PIXELS * 3 * (1 + 4)

    @property
    def rows_per_frame(self) -> int:
        return (self.height // limits.SPATIAL_MULTIPLE) * (self.width // limits.SPATIAL_MULTIPLE)

    @property
    def video_rows(self) -> int:
        return self.latent_frames * self.rows_per_frame

    @property
    def audio_rows(self) -> int:
        return limits.AUDIO_CHANNELS * geometry.audio_latents(self.num_frames)

    @property
    def text_tokens(self) -> int:
        """Prompt tokens plus each image's presentation (label + one vision token per 32x32 pixels)."""
        per_image = PRESENTATION_TOKENS + (self.height // VISION_MERGE) * (self.width // VISION_MERGE)
        return self.prompt_tokens + self.images * per_image

    @property
    def seq_len(self) -> int:
        return self.text_tokens + self.images * self.rows_per_frame + self.audio_rows + self.video_rows

    def describe(self) -> str:
        return (
            f"{self.task} {self.width}x{self.height}, {self.num_frames} frames ({self.num_frames / limits.FPS:.3f} s), "
            f"{self.seq_len} DiT rows ({self.text_tokens} text)"
        )


def denoise(
    cfg: H3TransformerConfig,
    d: ParallelDegrees,
    shape: RequestShape,
    es: int,
    chunk_rows: int | None = None,
    engine: str = H3SERVE,
    vsa: str | None = None,
) -> int:
    """One rank's denoise estimate; `vsa`: the DiT blocks run video sparse attention on this device type ("cuda":
    FlexAttention block masks, else the float32 reference), whose tile buffers add to the block's."""
    s = shape.seq_len
    s_local = math.ceil(s / d.sequence_parallel)
    dim = cfg.hidden_size
    heads_cols = cfg.num_attention_heads // d.tensor_parallel * cfg.attention_head_dim
    ffn_cols = cfg.ffn_dim // d.tensor_parallel
    ring = 0
    if d.ring > 1:  # the stacked k/v block in flight and its receive slot, the fp32 online-softmax accumulator
        ring = 4 * heads_cols * es + 3 * heads_cols * 4
    exchange = ULYSSES_EXCHANGE[engine] * heads_cols * es if d.ulysses > 1 else 0
    if chunk_rows is not None and chunk_rows < s_local:
        block = chunked_block(dim, heads_cols, ffn_cols, s_local, chunk_rows, es) + s_local * (ring + exchange)
    else:
        attention = 6 * heads_cols * es + ring + exchange
        block = s_local * (dim * (6 + 2) * es + max(attention, 4 * ffn_cols * es))
    if vsa is not None:
        block += vsa_buffers(cfg, d, shape, es, vsa)
    heads = 4 * s * dim * es
    rope = 2 * s_local * 6 * cfg.rope_freq_dim * 4
    rows = 4 * 4 * (shape.video_rows * cfg.video_patch_dim + shape.audio_rows * cfg.audio_in_channels)
    return (max(block, heads) + rows) * shape.batch + rope  # a batch shares the RoPE tables


VSA_TILE_ROWS, VSA_CUBE = 64, 4  # h3serve.accel.video_sparse's tiles: 64 rows, 4x4x4 video cubes
VSA_SCORE_CHUNK = 1 << 24  # the reference's fine-branch score block (elements), h3serve.accel.video_sparse


def vsa_tiles(shape: RequestShape) -> int:
    """Tiles of the packed sequence: runs of 64 rows before the target video, then its 4x4x4 latent cubes."""
    rows, cols = shape.height // limits.SPATIAL_MULTIPLE, shape.width // limits.SPATIAL_MULTIPLE
    cubes = math.prod(math.ceil(n / VSA_CUBE) for n in (shape.latent_frames, rows, cols))
    return math.ceil((shape.seq_len - shape.video_rows) / VSA_TILE_ROWS) + cubes


def vsa_buffers(cfg: H3TransformerConfig, d: ParallelDegrees, shape: RequestShape, es: int, device_type: str) -> int:
    """One attention call's video sparse attention buffers on one rank (h3serve.accel.video_sparse), beside q, k,
    v and the output: the gate [S, heads/TP·Dh] in es, the fine output and each row's coarse output in fp32, the
    tile tables [heads/TP, N, N] (fp32 scores, bool selection) and, per path: on CUDA the tile-ordered q, k, v and
    output [N·64, heads/TP·Dh] in es and the block mask's two int32 index tables; off CUDA (the reference) fp32
    copies of q, k, v, each query tile's allowed key rows [heads/TP, N, S] and one fp32 score block with its
    softmax."""
    s, n = shape.seq_len, vsa_tiles(shape)
    heads = cfg.num_attention_heads // d.tensor_parallel
    cols = heads * cfg.attention_head_dim
    common = s * cols * es + 2 * s * cols * 4 + heads * n * n * (4 + 1)
    if device_type == "cuda":
        return common + 4 * n * VSA_TILE_ROWS * cols * es + 2 * heads * n * n * 4
    return common + 3 * s * cols * 4 + heads * n * s + 2 * min(heads * s * s, VSA_SCORE_CHUNK) * 4


def chunked_block(dim: int, heads_cols: int, ffn_cols: int, rows: int, chunk_rows: int, es: int) -> int:
    """A block run in row chunks (`TransformerBlock.modulated_in_chunks`): whole, the residual stream in and out
    and q, k, v and the attention output [rows, heads/TP·Dh]; per chunk of at most `chunk_rows` rows, the larger
    of its two passes: (1) two gathered modulations, the normalised input, the fused q|k|v projection and the
    normalised, rotated q and k (two RoPE temporaries each); (2) the gate, the output projection, the residual
    midpoint, two modulations, the FFN input, its fused [value; gate] output, silu(gate) and the product, the gate."""
    whole = rows * (2 * dim + 4 * heads_cols) * es
    chunk = min(rows, chunk_rows)
    first = 3 * dim + 3 * heads_cols + 4 * heads_cols
    second = 7 * dim + 4 * ffn_cols
    return whole + chunk * max(first, second) * es


def text_encode(t: TextShape, d: ParallelDegrees, shape: RequestShape, es: int, runs_encoder: bool) -> int:
    tokens = shape.text_tokens
    if not runs_encoder:
        return tokens * t.hidden * es
    tp = d.text_encoder_tp
    attn = (2 * t.heads + 2 * t.kv_heads) * t.head_dim // tp
    layer = tokens * es * (attn + 3 * t.intermediate // tp + 2 * t.hidden)
    return HIDDEN_STATES_KEPT * tokens * t.hidden * es + layer


def vae_encode(v: VaeShape, shape: RequestShape) -> int:
    """The larger of the keyframes' encode (one frame) and a source video's, which goes one VAE clip at a time
    (`encode_visual_condition`): the clip's pixels on the device (uint8 and, padded, twice in fp32), the encoder's
    feature maps for each of its frames on one tile, and the whole video's moments (mean and log-variance, fp32)."""
    keyframes = 0
    if shape.images:
        keyframes = 8 * v.encoder_width * v.tile**2 * 4 + 2 * 3 * shape.width * shape.height * 4
    source = 0
    if shape.source_frames:
        clip = limits.VAE_FRAMES_PER_CHUNK
        pixels = 3 * clip * shape.width * shape.height * (1 + 2 * 4)
        per_frame = (shape.height // limits.VAE_SPATIAL_COMPRESSION) * (shape.width // limits.VAE_SPATIAL_COMPRESSION)
        latents = geometry.latent_frames(shape.source_frames) * per_frame
        moments = 2 * v.latent_channels * latents * 4
        source = pixels + clip * 8 * v.encoder_width * v.tile**2 * 4 + moments
    return max(keyframes, source)


def _tiles(length: int, tile: int) -> int:
    """Spatial tiles along one axis (docs/model.md §5: 256-px tiles with at least 64 px overlap)."""
    overlap = tile // 4
    return 1 if length <= tile else math.ceil((length - overlap) / (tile - overlap))


def video_decode(v: VaeShape, d: ParallelDegrees, shape: RequestShape, es: int, stitches: bool) -> int:
    chunks = shape.latent_frames // limits.VAE_LATENTS_PER_CHUNK
    tiles = _tiles(shape.width, v.tile) * _tiles(shape.height, v.tile)
    clip_frames = VAE_CLIP_LATENTS * VAE_TEMPORAL_RATIO
    unit = 3 * clip_frames * v.tile**2 * es
    units = tiles if shape.streamed_decode else chunks * tiles
    ratio = limits.VAE_SPATIAL_COMPRESSION
    tokens = VAE_CLIP_LATENTS * (v.tile // ratio) ** 2
    working = tokens * (8 * v.decoder_width + 3 * v.decoder_ffn) * 4
    if not stitches:
        return 2 * math.ceil(units / d.vae_patch_parallel) * unit + working
    video = shape.num_frames * shape.width * shape.height * 3
    # With patch parallel the stitching rank also holds its own units and the gather's send buffer.
    gathered = units * unit * (1 + (2 / d.vae_patch_parallel if d.vae_patch_parallel > 1 else 0))
    if shape.streamed_decode:
        frame = 3 * shape.width * shape.height
        # One rank decodes the clip's tiles one by one (a tile and its unpatchified copy); patch parallel
        # gathers them all on the stitching rank first.
        tiles_alive = gathered if d.vae_patch_parallel > 1 else 2 * unit
        clip_and_tail = (clip_frames + VAE_FRAME_OVERLAP) * frame * es
        return int(tiles_alive + clip_and_tail + 2 * frame * 4) + working
    return int(max(gathered + 2 * video * es, video * es + 2 * video * 4)) + working


def whole_video_decode(v: VaeShape, shape: RequestShape) -> int:
    """vLLM-Omni's decode (measured_engine, "whole-video decode"), on every rank of the tile group: the whole video in
    fp32 with the processor's three copies of it, or while the clips decode the fp32 video and one clip's tiles
    (the rank's own and the gathered ones, fp16 under autocast), whichever is larger; plus the tile's working set."""
    video = 3 * shape.num_frames * shape.width * shape.height * 4
    clip_tiles = _tiles(shape.width, v.tile) * _tiles(shape.height, v.tile)
    unit = 3 * VAE_CLIP_LATENTS * VAE_TEMPORAL_RATIO * v.tile**2 * 2
    tokens = VAE_CLIP_LATENTS * (v.tile // limits.VAE_SPATIAL_COMPRESSION) ** 2
    working = tokens * (8 * v.decoder_width + 3 * v.decoder_ffn) * 4
    return max(WHOLE_VIDEO_COPIES * video, video + 2 * clip_tiles * unit) + working


def audio_decode(shape: RequestShape) -> int:
    latents = shape.audio_rows // limits.AUDIO_CHANNELS
    window = latents if latents <= 2 * WINDOW_LATENTS else WINDOW_LATENTS + 2 * RELEASED_AUDIO_HALO + ALIGNMENT - 1
    output = limits.AUDIO_CHANNELS * 800 * latents * 4
    return 8 * AUDIO_WIDEST * window * limits.AUDIO_CHANNELS * 4 + output


def stage_activations(
    inv: Inventory, rank: int, stage: str, shape: RequestShape, dit: str, chunk_rows: int | None = None,
    vsa: bool = False,
) -> int:
    """The estimate for one rank and stage (see the module docstring); `chunk_rows`: the denoise blocks' row chunk;
    `vsa`: the DiT blocks run video sparse attention."""
    es, d = inv.element_size, inv.degrees
    if stage == "text_encode":
        return text_encode(inv.text, d, shape, es, "text_encoder" in inv.ranks[rank])
    if stage == "vae_encode":
        return vae_encode(inv.vae, shape)
    if stage == "denoise":
        return denoise(inv.dits[dit], d, shape, es, chunk_rows, inv.engine, inv.device_type if vsa else None)
    if stage == "video_decode":
        if inv.engine == VLLM_OMNI:
            return whole_video_decode(inv.vae, shape)
        return video_decode(inv.vae, d, shape, es, stitches=rank == 0 or d.vae_patch_parallel == 1)
    if stage == "audio_decode":
        return audio_decode(shape)
    raise ValueError(f"unknown stage {stage!r}")
