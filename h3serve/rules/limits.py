"""The model card's numbers, defined once. Every other module imports them from here."""

from __future__ import annotations

# Output contract.
FPS = 24
AUDIO_SAMPLE_RATE = 32_000
AUDIO_CHANNELS = 2
AUDIO_LATENTS_PER_SECOND = 40  # audio VAE hop 800 at 32 kHz

# Video VAE temporal geometry: frame counts are 17n + 5, giving 5n + 2 latent frames.
VAE_FRAMES_PER_CHUNK = 17
VAE_LATENTS_PER_CHUNK = 5
VAE_SPATIAL_COMPRESSION = 16
PATCH_SIZE = (1, 2, 2)
SPATIAL_MULTIPLE = VAE_SPATIAL_COMPRESSION * PATCH_SIZE[2]  # 32: both canvas edges are multiples of it

# Request rules.
MAX_EDGE = 4096  # either canvas edge, in pixels (the released checkpoint; ModelDefaults may lower it)
MIN_DURATION_S = 4.0
MAX_DURATION_S = 15.0  # without long_video
DEFAULT_DURATION_S = 5.0
MIN_ASPECT_RATIO = 1 / 4
MAX_ASPECT_RATIO = 4.0
DEFAULT_ASPECT_RATIO = (16, 9)
MAX_PROMPT_CHARS = 7_000
MIN_STEPS = 1
MAX_STEPS = 200
DEFAULT_STEPS = 50
SEED_MIN = 0
SEED_MAX = 2**63 - 1
DEFAULT_SEED = 42
# Several outputs of one prompt (num_outputs_per_prompt): output i is the single request at seed + i.
MAX_OUTPUTS_PER_PROMPT = 10
# control_context_scale of a ControlNet request (default 1; 0: no control). vLLM-Omni sets no upper bound; the hint
# is added to the DiT's hidden states times the scale, and past ~10 it swamps them (bf16 overflows long before 1e308).
MAX_CONTROL_SCALE = 10.0
# Sigma shifts (video default 12, audio 3). Far below the ~2e4 where fp32 schedules start to collapse, so the
# video and audio schedules always have the same number of steps.
MAX_FLOW_SHIFT = 100.0

# Input media (keyframes and references): per-file byte limits and the total count of files in one request.
MAX_IMAGE_BYTES = 30 * 2**20
MAX_VIDEO_BYTES = 50 * 2**20
MAX_AUDIO_BYTES = 15 * 2**20
MAX_MEDIA_FILES = 12

# Conditioning constants of the released model.
TEXT_ENCODER_LAYER = 50  # hidden_states[50]: the 50th decoder layer's output, before the final norm
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
KEYFRAME_ENCODE_SEED = 42
KEYFRAME_NOISE_AUG_T = 0.999

# Modality tags (AdaLN slot per row).
VIDEO_TAG = 0
TEXT_TAG = 1
AUDIO_TAG = 2

# Media intake (h3serve/media/media_inputs.py): what one input file may be, and what a Ref2VA reference set may hold.
# Per-file byte limits and the total file count are MAX_*_BYTES and MAX_MEDIA_FILES above. Durations are measured
# by decoding (frames / fps, samples / rate), never read from container headers.
MEDIA_IMAGE_MIN_EDGE = 256  # both edges of an image, in pixels (after EXIF orientation)
MEDIA_IMAGE_MAX_EDGE = 5760
MEDIA_MAX_ASPECT = (5, 2)  # long edge : short edge at most 5:2, images and videos alike (5:2 to 2:5)
MEDIA_CLIP_MIN_S = 2.0  # each reference video clip and each reference audio clip
MEDIA_CLIP_MAX_S = 15.0
MEDIA_DURATION_SLACK_S = 0.05  # codec framing (AAC priming, MP3 without gapless info) read as in-limit
MEDIA_VIDEO_MAX_DECODED_BYTES = 16 * 2**30  # guard, not from the model card: decoded rgb24 frames of one video
# The pixel budget of every decoded upload (h3serve/media/pixel_budget.py), read from the header before anything is
# decoded: each video frame (references, edit and extension sources, control videos and masks) and each control mask
# image at most this many pixels (DCI 4K, 4096x2160, and UHD fit), no edge longer than MEDIA_IMAGE_MAX_EDGE.
# Guards, not from the model card: the model sees the canvas, so a larger frame only costs the decoder memory.
MEDIA_MAX_FRAME_PIXELS = 4096 * 2304
REF_MAX_IMAGES = 9
REF_MAX_VIDEOS = 3
REF_MAX_AUDIOS = 3
REF_TOTAL_MAX_S = 15.0  # per modality: all reference video clips together; all reference audio clips together

# Long video (h3serve/rules/long_video.py). The limits: one pass up to 30 s (long_video_mode=full), windowed
# continuation up to 300 s. Windows and overlaps are frame counts on the 17n + 5 grid.
MAX_FULL_DURATION_S = 30.0
MAX_CONTINUATION_DURATION_S = 300.0
DEFAULT_WINDOW_FRAMES = 277
DEFAULT_OVERLAP_FRAMES = 22
MIN_WINDOW_FRAMES = 107
MAX_WINDOW_FRAMES = 345
MIN_OVERLAP_FRAMES = 5

# Latent-mask editing: sources and masks (JSON) as uploaded; a mask's JSON nesting depth stays below this.
MAX_SOURCE_BYTES = 512 * 2**20
MAX_MASK_BYTES = 8 * 2**20
MAX_MASK_NESTING = 64

# Real-time sessions (TaoMate-H3, h3serve/rules/realtime_geometry.py): up to ten minutes of 24 fps video per session,
# on a canvas whose short edge is one the streaming LoRA was served at (vLLM-Omni), or the checkpoint's own canvas.
MAX_REALTIME_FRAMES = 10 * 60 * FPS  # 14,400
REALTIME_SHORT_EDGES = (480, 768, 1088)
REALTIME_DEFAULT_SIZE = (480, 864)  # (width, height): vLLM-Omni's TaoMate-H3 canvas, the start-up plan's

# WS /v1/realtime/video, as vLLM-Omni's serving_video_output_stream: `session.start` first, within 10 s and at most
# 4 MiB; every later message at most 128 KiB; a session with no progress (a chunk, or the client's ping) for 60 s
# is ended.
REALTIME_START_TIMEOUT_S = 10.0
REALTIME_START_MESSAGE_BYTES = 4 * 2**20
REALTIME_CONTROL_MESSAGE_BYTES = 128 * 2**10
REALTIME_STALL_TIMEOUT_S = 60.0

# Webhooks (docs/webhooks.md): endpoints per API key, their fields, and the deliveries. A receiver's answer is read to
# at most 4 KiB; a delivery is retried with exponential backoff (doubling from --webhook-retry-initial, at most an
# hour apart, with jitter) until --webhook-retry-horizon after its event, then marked failed. A rotated secret stays
# valid 24 h when asked (the SDK's `keep_old_secret_active_for_24_hours`).
MAX_WEBHOOK_ENDPOINTS = 100
MAX_WEBHOOK_NAME_CHARS = 256
MAX_WEBHOOK_URL_CHARS = 2048
WEBHOOK_RESPONSE_BYTES = 4 * 2**10
WEBHOOK_MAX_REDIRECTS = 3  # 307/308 only: a POST stays a POST with its body; each hop passes the URL guard
WEBHOOK_TIMEOUT_S = 10.0  # one attempt, connection and answer (every redirect hop) together
WEBHOOK_RETRY_INITIAL_S = 5.0
WEBHOOK_RETRY_MAX_S = 3600.0
WEBHOOK_RETRY_HORIZON_S = 86_400.0
WEBHOOK_SECRET_GRACE_S = 86_400
WEBHOOK_RETENTION_S = 30 * 86_400  # delivered and failed deliveries are kept this long (the page shows them)
