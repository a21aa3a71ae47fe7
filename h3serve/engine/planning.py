"""Request -> plan, shared by every entry point: intake checks the media, then the request rules apply.

No torch here: the API process calls this on the event loop's executor to answer 4xx before queueing.
"""

from __future__ import annotations

from h3serve.media import intake
from h3serve.request import GenerationRequest
from h3serve.validate import GenerationPlan, ModelDefaults, resolve_task, validate


def plan_request(request: GenerationRequest, defaults: ModelDefaults) -> GenerationPlan:
    """Validate a request and its media. Raises `RequestError` or `intake.MediaError` (both client errors)."""
    task = resolve_task(request)
    keyframe_size = None
    if task == "fl2va":
        fields = [("image", request.image), ("last_image", request.last_image)]
        images = [intake.load_image(ref, field) for field, ref in fields if ref is not None]
        keyframe_size = images[0].image.size
    elif task == "ref2va":
        intake.load_references(request.references)
    return validate(request, defaults, keyframe_size)
