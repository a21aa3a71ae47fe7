"""Place a request's stored media on its `GenerationRequest`: keyframes, references or edit sources.

Where each file goes (`keyframes_requested` decides):
- `extra_params.task` fl2va: every file is a keyframe image, whatever field it came in;
- any other task given (ref2va, t2va): every file is a Ref2VA reference;
- no task: `input_reference` (the OpenAI SDK's single image, at most one file) is the first keyframe, so
  the request is FL2VA; files in `input_references` and `image_reference` / `video_reference` /
  `audio_reference` are references, so it is Ref2VA (the task is left for `validate` to infer).
Keyframes are placed by `frame_indices`: [0] first, [-1] last, [0, -1] both; default [0] for one image
and [0, -1] for two.
"""

from __future__ import annotations

import dataclasses

from h3serve.api.error_envelope import bad_request
from h3serve.api.media_fields import SOURCE_FIELDS
from h3serve.api.media_inputs import StoredMedia
from h3serve.rules.request import GenerationRequest, MediaRef

FIRST, LAST = 0, -1
KEYFRAME_FIELD = "input_reference"


def keyframes_requested(task: str | None, media: list[StoredMedia]) -> bool:
    """Whether the files are FL2VA keyframes (else Ref2VA references); the rule is the module docstring's."""
    if task is not None:
        return task == "fl2va"
    return bool(media) and all(m.source.field == KEYFRAME_FIELD for m in media)


def _keyframes(
    media: list[StoredMedia], frame_indices: tuple[int, ...] | None
) -> tuple[MediaRef | None, MediaRef | None]:
    for m in media:
        if m.kind != "image":
            found = f"a {m.kind} file" if m.kind else "not a recognisable image"
            raise bad_request(f"{m.source.field}: fl2va takes images only (keyframes); this is {found}", m.source.field)
    if len(media) > 2:
        raise bad_request(
            f"fl2va takes at most 2 images (first and last keyframe), got {len(media)}", media[2].source.field
        )
    indices = frame_indices or ((FIRST,) if len(media) == 1 else (FIRST, LAST))
    if len(indices) != len(media) or len(set(indices)) != len(indices) or not set(indices) <= {FIRST, LAST}:
        raise bad_request(
            f"frame_indices: must be [0], [-1] or [0, -1], one index per keyframe image ({len(media)} given), "
            f"got {list(indices)}",
            "extra_params.frame_indices",
        )
    by_index = {index: m.ref for index, m in zip(indices, media, strict=True)}
    return by_index.get(FIRST), by_index.get(LAST)


def place_media(
    request: GenerationRequest, media: list[StoredMedia], frame_indices: tuple[int, ...] | None
) -> GenerationRequest:
    """`request` (without media yet) with each stored file in its place; 400 naming the field on a file that
    cannot go there. `frame_indices`: the request's, for FL2VA keyframes."""
    sources = {m.source.field: m.ref for m in media if m.source.field in SOURCE_FIELDS}
    media = [m for m in media if m.source.field not in SOURCE_FIELDS]
    request = dataclasses.replace(request, **sources)
    if keyframes_requested(request.task, media):
        image, last_image = _keyframes(media, frame_indices) if media else (None, None)
        return dataclasses.replace(request, image=image, last_image=last_image)
    if frame_indices is not None:
        raise bad_request("frame_indices: only fl2va keyframe images take frame indices", "extra_params.frame_indices")
    return dataclasses.replace(request, references=tuple(m.ref for m in media))


def media_aliases(request: GenerationRequest, media: list[StoredMedia]) -> dict[str, str]:
    """How validation errors name each file ("image", "references[2]") -> the field the client sent it in."""
    source_of = {id(m.ref): m.source.field for m in media}
    named = [("image", request.image), ("last_image", request.last_image)]
    named += [(f"references[{i}]", ref) for i, ref in enumerate(request.references)]
    named += [(name, getattr(request, name)) for name in SOURCE_FIELDS]
    return {name: source_of[id(ref)] for name, ref in named if ref is not None and id(ref) in source_of}
