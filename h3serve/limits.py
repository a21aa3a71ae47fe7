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
MIN_DURATION_S = 4.0
MAX_DURATION_S = 15.0
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
