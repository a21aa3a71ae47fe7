"""Request rules shared by every entry point: one `GenerationRequest` in, one `GenerationPlan` out.

A violation raises `RequestError` naming the field and the limit, so the CLI prints one line and the
server answers HTTP 400 with the same text. `resolve.validate` is the entry; the rules of the inputs (task,
media, edits) are in `inputs`, those of the length (frames, long video, windows) in `length`.
"""

from h3serve.errors import RequestError
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.validate.generation_plan import GenerationPlan
from h3serve.rules.validate.inputs import driving_audio_split, resolve_start_times, resolve_task
from h3serve.rules.validate.length import resolve_long_video_mode
from h3serve.rules.validate.resolve import validate

__all__ = [
    "GenerationPlan",
    "ModelDefaults",
    "RequestError",
    "driving_audio_split",
    "resolve_long_video_mode",
    "resolve_start_times",
    "resolve_task",
    "validate",
]
