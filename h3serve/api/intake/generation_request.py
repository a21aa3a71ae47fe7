"""A create request made into the `GenerationRequest` the job manager queues: its media stored as files in the
job's input folder, each placed as a keyframe, a reference or an edit source, and its adapter resolved.

Storing: the files live under the data dir, so a job that is re-run after a restart still finds them. The intake's
per-file byte limits (`h3serve.rules.limits.MAX_*_BYTES`) apply by the file's kind: read from its bytes when they
are recognisable, else what the field declares; a file of unknown kind gets the largest limit and is left
to the media intake to reject.

Placing (`keyframes_requested` decides):
- `extra_params.task` fl2va: every file is a keyframe image, whatever field it came in;
- any other task given (ref2va, t2va): every file is a Ref2VA reference;
- no task: `input_reference` (the OpenAI SDK's single image, at most one file) is the first keyframe, so
  the request is FL2VA; files in `input_references` and `image_reference` / `video_reference` /
  `audio_reference` are references, so it is Ref2VA (the task is left for `validate` to infer).
Keyframes are placed by `frame_indices`: [0] first, [-1] last, [0, -1] both; default [0] for one image
and [0, -1] for two.
"""


from __future__ import annotations

import asyncio
import dataclasses
import re
import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from h3serve.adapters.catalog import LoraField
from h3serve.api.context import ServerContext
from h3serve.api.error_envelope import APIError, bad_request, from_request_error
from h3serve.api.intake.control import CONTROL_UPLOADS, control_request
from h3serve.api.intake.guide_fields import FILES_FIELD, guide_sources, manifest_entries, placed_guides
from h3serve.api.intake.read import KEYFRAME_FIELD, SOURCE_FIELDS, CreateRequest, MediaSource
from h3serve.api.url_fetch import MediaFetcher, MediaFetchError
from h3serve.media.media_inputs import MAX_BYTES
from h3serve.media.raw import atomic_output
from h3serve.media.sniff import HEAD_BYTES, identify, read_head
from h3serve.rules import limits
from h3serve.rules.request import GenerationRequest, MediaKind, MediaRef
from h3serve.rules.validate import RequestError

BYTE_LIMITS: dict[MediaKind, int] = MAX_BYTES  # the intake's own per-kind limits, applied before it runs
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 80
FIRST, LAST = 0, -1


@dataclass(frozen=True)
class StoredMedia:
    source: MediaSource
    ref: MediaRef
    kind: MediaKind | None  # from the bytes when recognisable, else as declared


async def build_generation_request(
    create: CreateRequest, job_id: str, ctx: ServerContext
) -> tuple[GenerationRequest, dict[str, str]]:
    """The request to queue, with its media stored in the job's inputs and placed, and its adapter resolved; and
    how validation errors name each value (-> the field the client sent it in). 400/413 naming the field."""
    defaults = ctx.manager.defaults
    guide_limits = defaults.guide_limits
    entries = manifest_entries(create.guides, guide_limits.max_entries, guide_limits.max_unique_files,
                               defaults.guide_refusal)
    guide_inputs = [MediaSource(field, None, upload=value) if isinstance(value, UploadFile)
                    else MediaSource(field, _kind_of(field), url=value)
                    for field, value in guide_sources(entries, create.guides.uploads)]
    media: list[StoredMedia] = []
    if create.sources or guide_inputs:
        folder = await run_in_threadpool(ctx.manager.files.inputs_dir, job_id)
        media = await store_media((*create.sources, *guide_inputs), folder, ctx.fetcher)
    guide_media = media[len(create.sources) :]
    media = media[: len(create.sources)]
    upload_kinds = [m.kind for m in guide_media if m.source.field.startswith(FILES_FIELD)]
    guides = placed_guides(entries, {m.source.field: m.ref for m in guide_media}, upload_kinds)
    fields = create.fields
    controls = {m.source.field: m.ref for m in media if m.source.field in CONTROL_UPLOADS}
    placed = place_media(fields.to_request(), [m for m in media if m.source.field not in CONTROL_UPLOADS],
                         fields.frame_indices())
    control = control_request(fields, controls, ctx.config.control_dir)
    generation_request = with_lora(dataclasses.replace(placed, control=control, guides=guides), create.lora, ctx)
    return generation_request, {**fields.client_names(), **media_aliases(generation_request, media)}


def _kind_of(field: str) -> MediaKind:
    """The kind a URL source's field names: timeline_guides[2].video -> video."""
    kind = field.rsplit(".", 1)[-1]
    if kind not in BYTE_LIMITS:
        raise ValueError(f"not a guide source field: {field}")
    return kind


def with_lora(generation_request: GenerationRequest, field: LoraField | None, ctx: ServerContext) -> GenerationRequest:
    """The request with its `lora` object resolved against the server's catalog (400 naming the sub-field)."""
    if field is None:
        return generation_request
    if ctx.lora is None:
        raise bad_request("lora: this server serves no LoRA adapters (start it with --lora-path or --lora-dir)", "lora")
    try:
        choice = ctx.lora.choose(field)
    except RequestError as e:
        raise from_request_error(e, {}) from None
    return dataclasses.replace(generation_request, lora=choice)


def _limit(kind: MediaKind | None, field: str = "") -> int:
    if field in SOURCE_FIELDS:
        return limits.MAX_SOURCE_BYTES  # latent-mask editing sources
    return BYTE_LIMITS[kind] if kind else max(BYTE_LIMITS.values())


def _declared_kind(content_type: str | None) -> MediaKind | None:
    major = (content_type or "").split("/")[0].strip().lower()
    return next((kind for kind in BYTE_LIMITS if kind == major), None)


def _file_name(index: int, client_name: str) -> str:
    """`03-clip.mp4`: the position keeps names unique; the client's name is reduced to safe characters."""
    stem = _UNSAFE.sub("_", Path(client_name).name).lstrip(".")[:_MAX_NAME] or "media"
    return f"{index:02d}-{stem}"


def _too_large(source: MediaSource, kind: MediaKind | None, size: int) -> APIError:
    what = "edit sources" if source.field in SOURCE_FIELDS else f"{kind} files" if kind else "media files"
    return APIError(
        413,
        f"{source.field}: {size / 2**20:.1f} MiB is over the {_limit(kind, source.field) // 2**20} MiB limit for "
        f"{what}.",
        "file_too_large",
        source.field,
    )


def _copy(src: BinaryIO, dest: Path) -> None:
    src.seek(0)
    with atomic_output(dest) as tmp, open(tmp, "wb") as f:
        shutil.copyfileobj(src, f, 1 << 20)


async def _store_upload(index: int, source: MediaSource, upload: UploadFile, folder: Path) -> StoredMedia:
    declared = source.kind or _declared_kind(upload.content_type)
    await upload.seek(0)
    fmt = identify(await upload.read(HEAD_BYTES))
    kind = fmt.kind if fmt else declared
    size = upload.size or 0
    if size > _limit(kind, source.field):
        raise _too_large(source, kind, size)
    name = upload.filename or "upload"
    dest = folder / _file_name(index, name)
    await asyncio.to_thread(_copy, upload.file, dest)
    return StoredMedia(source, MediaRef(path=dest, name=name, kind=declared), kind)


def _url_file_name(url: str) -> str:
    """The last path segment of an http(s) URL ("" for a data URL or one too malformed to split)."""
    if url.startswith("data:"):
        return "data"
    try:
        return urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1]
    except ValueError:  # e.g. "http://[::1": the fetcher reports what is wrong with it
        return ""


async def _store_url(
    index: int, source: MediaSource, url: str, folder: Path, fetcher: MediaFetcher, deadline: float
) -> StoredMedia:
    name = url[: url.find(",")] + ",..." if url.startswith("data:") else url
    dest = folder / _file_name(index, _url_file_name(url))
    try:
        media_type = await fetcher.fetch(url, dest, _limit(source.kind, source.field), deadline)
    except MediaFetchError as e:
        status, code = (413, "file_too_large") if e.too_large else (400, "invalid_media_url")
        raise APIError(status, f"{source.field}: {e}", code, source.field) from None
    fmt = identify(await asyncio.to_thread(read_head, dest))
    kind = fmt.kind if fmt else source.kind or _declared_kind(media_type)
    size = (await asyncio.to_thread(dest.stat)).st_size
    if size > _limit(kind, source.field):
        raise _too_large(source, kind, size)
    return StoredMedia(source, MediaRef(path=dest, name=name, kind=source.kind), kind)


async def store_media(sources: tuple[MediaSource, ...], folder: Path, fetcher: MediaFetcher) -> list[StoredMedia]:
    """Every source saved into `folder`, in order. Raises `APIError` (400/413) naming the failing input.

    The URLs of one request share one deadline (`fetcher.timeout_s`), so a request of many slow URLs cannot
    hold its uploads and a queue slot for many times the fetch timeout."""
    stored = []
    deadline = fetcher.deadline()
    for index, source in enumerate(sources):
        if source.upload is not None:
            stored.append(await _store_upload(index, source, source.upload, folder))
        else:
            assert source.url is not None
            stored.append(await _store_url(index, source, source.url, folder, fetcher, deadline))
    return stored


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
    for field, ref in sources.items():
        request = dataclasses.replace(request, **{field: ref})  # type: ignore[arg-type]  # a media field's name
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
    if request.control is not None:  # its media are named by their uploads
        named += [(f"extra_params.{request.control.type}.{part}_path", getattr(request.control, part))
                  for part in ("control", "source", "mask")]
    return {name: source_of[id(ref)] for name, ref in named if ref is not None and id(ref) in source_of}
