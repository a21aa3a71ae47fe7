"""The names a request and a flag may take, defined once: tasks, task types, audio and long-video modes, quality,
sample solvers.

Leaf module. Each is a `Literal` (the pydantic request model and the type hints use it) and the tuple of its
values (validation, CLI choices, OpenAPI enums and the web page's config derive from it).
"""

from __future__ import annotations

from typing import Literal, get_args

Task = Literal["t2va", "fl2va", "ref2va"]
TASKS: tuple[str, ...] = get_args(Task)

# --task-type: which DiTs an engine loads. `auto` loads every DiT the checkpoint has; FL2VA's DiT also serves T2VA.
TaskType = Literal["auto", "fl2va", "ref2va"]
TASK_TYPES: tuple[str, ...] = get_args(TaskType)
# The spellings --task-type accepts (vLLM-Omni's among them), each mapped to the task type it means.
TASK_TYPE_ALIASES: dict[str, str] = {"auto": "auto", "combined": "auto", "t2va": "fl2va", "fl2va": "fl2va",
                                     "ref2va": "ref2va"}

AudioMode = Literal["native", "lock_source"]
AUDIO_MODES: tuple[str, ...] = get_args(AudioMode)

LongVideoMode = Literal["full", "continuation"]
LONG_VIDEO_MODES: tuple[str, ...] = get_args(LongVideoMode)

Quality = Literal["lossless", "high"]  # the request field `quality`: DiT cache policy (h3serve.accel.cache)
QUALITIES: tuple[str, ...] = get_args(Quality)

# extra_params.sample_solver: euler (the reference's eta-0 Euler) or res_multistep (ComfyUI's second-order RES
# multistep, h3serve.model.scheduler). Read case-insensitively, surrounding whitespace ignored (as vLLM-Omni does).
SampleSolver = Literal["euler", "res_multistep"]
SAMPLE_SOLVERS: tuple[str, ...] = get_args(SampleSolver)
DEFAULT_SAMPLE_SOLVER: SampleSolver = "euler"

# Fun ControlNet Union control types (extra_params.<type>, `generate --control TYPE=FILE`): inpaint needs a mask, the
# others a control video (h3serve.model.controlnet).
ControlType = Literal["canny", "depth", "hed", "mlsd", "pose", "inpaint"]
CONTROL_TYPES: tuple[str, ...] = get_args(ControlType)

# Webhook event types h3serve sends (docs/webhooks.md): the two video events of OpenAI's SDK (its
# `client.webhooks.create(event_types=...)` literal names no cancellation event for videos; a deleted unfinished job
# sends video.failed). Endpoints may subscribe to these only.
WebhookEventType = Literal["video.completed", "video.failed"]
WEBHOOK_EVENT_TYPES: tuple[str, ...] = get_args(WebhookEventType)

# extra_params.force_refresh_step_policy (vLLM-Omni's, with force_refresh_step_hint): a DiT cache starts afresh once
# after `hint` forwards, or after every `hint` forwards (h3serve.rules.cache_refresh).
RefreshPolicy = Literal["once", "repeat"]
REFRESH_POLICIES: tuple[str, ...] = get_args(RefreshPolicy)

# --cache-backend values h3serve serves (the flag parser knows vLLM-Omni's others and refuses them with the reason).
CacheBackend = Literal["none", "cache_dit", "tea_cache"]
CACHE_BACKENDS: tuple[str, ...] = get_args(CacheBackend)

# --video-encoder: which H.264 encoder writes the MP4. auto: NVENC where the GPU has one and PyNvVideoCodec is
# installed (the `nvenc` extra), else x264 (h3serve.media.nvenc.choose_encoder; the log says which ran).
VideoEncoder = Literal["auto", "x264", "nvenc"]
VIDEO_ENCODERS: tuple[str, ...] = get_args(VideoEncoder)

# vLLM-Omni's x264 presets (extra_params.video_codec_options.preset, --x264-preset), fastest first.
X264Preset = Literal[
    "ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow", "placebo"
]
X264_PRESETS: tuple[str, ...] = get_args(X264Preset)
# The default x264 settings: superfast at CRF 16 matched or beat medium at CRF 18 (the default until 2026-12-06) in
# luma PSNR and SSIM on four test sources, for 0.2-0.4x its CPU time and 10-50 % more bytes (docs/benchmarks.md,
# "x264 presets at matched quality"). vLLM-Omni encodes with ultrafast at CRF 18. CRF is NVENC's constant QP too.
DEFAULT_X264_PRESET: X264Preset = "superfast"
DEFAULT_CRF = 16
