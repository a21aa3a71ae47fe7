"""The web playground at `/`: static files shipped in the package, plus the limits and defaults the page needs.

The page is plain HTML, CSS and ES modules (no build step, no Node at run time). `/web/config` tells it the
served model's defaults and the request rules (from `h3serve.rules.limits`, defined once), so its client-side checks
and the canvas it shows follow the same numbers the server enforces.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, HTMLResponse

from h3serve.api.context import ServerContext, get_context
from h3serve.api.error_envelope import APIError
from h3serve.media.previews import SPRITE_COLUMNS, SPRITE_ROWS
from h3serve.rules import limits
from h3serve.rules.names import (
    AUDIO_MODES,
    CONTROL_TYPES,
    DEFAULT_SAMPLE_SOLVER,
    LONG_VIDEO_MODES,
    SAMPLE_SOLVERS,
    TASKS,
)
from h3serve.rules.shown import shown

router = APIRouter(include_in_schema=False)
Context = Annotated[ServerContext, Depends(get_context)]
STATIC_DIR = Path(str(resources.files("h3serve.api").joinpath("static")))
MEDIA_TYPES = {
    ".html": "text/html", ".css": "text/css", ".js": "text/javascript",
    # the ready examples (static/examples/: h3serve.demo.web_examples)
    ".json": "application/json", ".png": "image/png", ".wav": "audio/wav",
}


@router.get("/")
def index() -> HTMLResponse:
    return HTMLResponse((STATIC_DIR / "index.html").read_text(encoding="utf-8"))


@router.get("/web/static/{name:path}")
def static_file(name: str) -> FileResponse:
    """A file of the page: a file under static/ (its scripts, its ready examples) with a known suffix."""
    try:
        path = (STATIC_DIR / name).resolve()
        found = path.is_relative_to(STATIC_DIR.resolve()) and path.suffix in MEDIA_TYPES and path.is_file()
    except (OSError, ValueError):  # a name the filesystem cannot hold (ENAMETOOLONG), a NUL byte
        found = False
    if not found:
        raise APIError(404, f"No such file: {shown(name)}", "file_not_found")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})


@router.get("/web/config")
def page_config(ctx: Context) -> dict[str, Any]:
    """Defaults of the served checkpoint and the request limits. Public: nothing here is secret."""
    d = ctx.manager.defaults
    return {
        "model": ctx.config.served_model_name,
        "api_key_required": ctx.config.api_key is not None,
        "tasks": list(ctx.manager.tasks),
        "max_body_bytes": ctx.config.max_body_bytes,
        "defaults": {
            "canvas_short_edge": d.canvas_short_edge,
            "canvas_max_pixels": d.canvas_max_pixels,
            "max_edge": d.max_edge,
            "flow_shift": d.flow_shift,
            "audio_flow_shift": d.audio_flow_shift,
            "steps": limits.DEFAULT_STEPS if d.pinned_schedule is None else d.pinned_schedule.forwards,
            "seed": limits.DEFAULT_SEED,
            "sample_solver": DEFAULT_SAMPLE_SOLVER,
            "duration_s": limits.DEFAULT_DURATION_S,
            "aspect_ratio": "{}:{}".format(*limits.DEFAULT_ASPECT_RATIO),
        },
        "names": {"tasks": TASKS, "audio_modes": AUDIO_MODES, "long_video_modes": LONG_VIDEO_MODES,
                  "sample_solvers": SAMPLE_SOLVERS, "control_types": CONTROL_TYPES},
        "limits": {
            "fps": limits.FPS,
            "frames_per_chunk": limits.VAE_FRAMES_PER_CHUNK,
            "frames_rest": limits.VAE_LATENTS_PER_CHUNK,
            "min_duration_s": limits.MIN_DURATION_S,
            "max_duration_s": limits.MAX_DURATION_S,
            "max_full_duration_s": limits.MAX_FULL_DURATION_S,
            "max_continuation_duration_s": limits.MAX_CONTINUATION_DURATION_S,
            "spatial_multiple": limits.SPATIAL_MULTIPLE,
            "min_aspect_ratio": limits.MIN_ASPECT_RATIO,
            "max_aspect_ratio": limits.MAX_ASPECT_RATIO,
            "max_prompt_chars": limits.MAX_PROMPT_CHARS,
            "min_steps": limits.MIN_STEPS,
            "max_steps": limits.MAX_STEPS,
            "max_outputs_per_prompt": limits.MAX_OUTPUTS_PER_PROMPT,
            "seed_max": str(limits.SEED_MAX),  # beyond JavaScript's safe integers
            "max_flow_shift": limits.MAX_FLOW_SHIFT,
        },
        "media": {
            "image_bytes": limits.MAX_IMAGE_BYTES,
            "video_bytes": limits.MAX_VIDEO_BYTES,
            "audio_bytes": limits.MAX_AUDIO_BYTES,
            "max_files": limits.MAX_MEDIA_FILES,
            "image_min_edge": limits.MEDIA_IMAGE_MIN_EDGE,
            "image_max_edge": limits.MEDIA_IMAGE_MAX_EDGE,
            "max_aspect": list(limits.MEDIA_MAX_ASPECT),
            "clip_min_s": limits.MEDIA_CLIP_MIN_S,
            "clip_max_s": limits.MEDIA_CLIP_MAX_S,
            "duration_slack_s": limits.MEDIA_DURATION_SLACK_S,
            "max_images": limits.REF_MAX_IMAGES,
            "max_videos": limits.REF_MAX_VIDEOS,
            "max_audios": limits.REF_MAX_AUDIOS,
            "total_max_s": limits.REF_TOTAL_MAX_S,
        },
        "spritesheet": {"columns": SPRITE_COLUMNS, "rows": SPRITE_ROWS},
        "realtime": {  # the Live mode (WS /v1/realtime/video): on a server started with --realtime-lora
            "enabled": ctx.config.realtime,
            "width": limits.REALTIME_DEFAULT_SIZE[0],
            "height": limits.REALTIME_DEFAULT_SIZE[1],
            "short_edges": sorted({*limits.REALTIME_SHORT_EDGES, d.canvas_short_edge}),
            "max_seconds": limits.MAX_REALTIME_FRAMES // limits.FPS,
        },
    }
