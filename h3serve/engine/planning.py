"""Request -> plan, shared by every entry point: intake checks the media, then the request rules apply.

No torch here: the API process calls this on the event loop's executor to answer 4xx before queueing.
"""

from __future__ import annotations

from h3serve.media import media_inputs as intake
from h3serve.media.control_media import check_control_media
from h3serve.media.source import check_source_header, frames_at_24fps
from h3serve.rules.request import GenerationRequest, MediaKind, MediaRef
from h3serve.rules.validate import (
    GenerationPlan,
    ModelDefaults,
    RequestError,
    driving_audio_split,
    resolve_start_times,
    resolve_task,
    validate,
)


def check_task_served(task: str, tasks: tuple[str, ...]) -> None:
    """`RequestError` on field "task" unless the loaded DiTs serve `task`."""
    if task not in tasks:
        raise RequestError(
            "task", f"{task} is not served here: the loaded DiT serves {', '.join(tasks)} (see --task-type)"
        )


def plan_request(
    request: GenerationRequest, defaults: ModelDefaults, tasks: tuple[str, ...] | None = None
) -> GenerationPlan:
    """Validate a request and its media, and (given `tasks`) that its task is served here.

    Raises `RequestError` or `intake.MediaError` (both client errors)."""
    request = driving_audio_split(request)  # lock_source: the driving audio is not a reference
    task = resolve_task(request)
    if tasks is not None:  # before the media: no point decoding files for a task that cannot run
        check_task_served(task, tasks)
    keyframe_size = None
    if task == "fl2va":
        fields = [("image", request.image), ("last_image", request.last_image)]
        images = [intake.load_image(ref, field) for field, ref in fields if ref is not None]
        keyframe_size = images[0].image.size
    elif task == "ref2va":
        starts = resolve_start_times(request, task)
        intake.check_references(request.references, starts)  # every rule, without keeping decoded frames
    extend_frames = None if request.extend_video is None else frames_at_24fps(request.extend_video, "extend_video")
    plan = validate(request, defaults, keyframe_size, extend_frames)
    sources: tuple[tuple[str, MediaRef | None, MediaKind], ...] = (
        ("source_video", plan.source_video, "video"), ("source_audio", plan.source_audio, "audio"))
    for field, ref, kind in sources:
        if ref is not None:  # kind, size and frame size; decoded when the job runs, only as far as needed
            check_source_header(ref, field, kind)
    if plan.control is not None:  # each input's kind, size and frame size from its header
        check_control_media(plan.control)
    return plan
