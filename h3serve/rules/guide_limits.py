"""`GuideLimits`: a server's limits on timeline guides (h3serve/rules/guides.py), vLLM-Omni's keys and defaults. A
value type below `ModelDefaults`, which carries it to every entry point."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from h3serve.errors import ConfigError
from h3serve.rules import limits

_RESERVED_LIMIT_KEYS = {  # vLLM-Omni's keys h3serve has no use for, with why (refused rather than ignored)
    "subprocess_timeout_seconds": "h3serve decodes guides inside the job, not in a subprocess",
    "max_outstanding_requests": "h3serve queues guided requests like any other (--max-queue)",
}


@dataclass(frozen=True)
class GuideLimits:
    """A server's limits on timeline guides (vLLM-Omni's keys and defaults). Reuse of one file counts once for
    bytes and once per entry for decoding."""

    max_entries: int = limits.GUIDE_MAX_ENTRIES
    max_unique_files: int = limits.GUIDE_MAX_UNIQUE_FILES
    max_image_bytes: int = limits.MAX_IMAGE_BYTES
    max_video_bytes: int = limits.MAX_VIDEO_BYTES
    max_audio_bytes: int = limits.MAX_AUDIO_BYTES
    max_total_upload_bytes: int = limits.GUIDE_MAX_TOTAL_UPLOAD_BYTES
    max_guide_rows: int = limits.GUIDE_MAX_GUIDE_ROWS
    max_packed_rows: int = limits.GUIDE_MAX_PACKED_ROWS
    max_source_pixels: int = limits.GUIDE_MAX_SOURCE_PIXELS
    max_decoded_visual_pixels: int = limits.GUIDE_MAX_DECODED_VISUAL_PIXELS
    max_decoded_audio_samples: int = limits.GUIDE_MAX_DECODED_AUDIO_SAMPLES

    @classmethod
    def from_json(cls, data: object) -> GuideLimits:
        """Limits from a JSON object of overrides: strict positive integers, known keys only (ValueError)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key in _RESERVED_LIMIT_KEYS:
                raise ValueError(f"{key} is not used: {_RESERVED_LIMIT_KEYS[key]}")
            if key not in known:
                raise ValueError(f"unknown key {key!r}; choose from: {', '.join(sorted(known))}")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        return cls(**dict(data))

    @classmethod
    def from_flag(cls, text: str) -> GuideLimits:
        """A server's limits: vLLM-Omni's defaults under --timeline-guide-limits' JSON overrides (`ConfigError`)."""
        try:
            return cls.from_json(json.loads(text or "{}"))
        except ValueError as e:  # json.JSONDecodeError is one
            raise ConfigError(f"--timeline-guide-limits: {e}") from None

    def max_bytes(self, kind: str) -> int:
        """The per-file byte limit of a guide of `kind` (image, video or audio)."""
        return {"image": self.max_image_bytes, "video": self.max_video_bytes, "audio": self.max_audio_bytes}[kind]
