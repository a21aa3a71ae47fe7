"""One media intake for the CLI and the server: FL2VA keyframes and Ref2VA references, files in, arrays out.

The type of a file comes from its bytes (`h3serve.media.sniff`), never from its name; a declared `MediaRef.kind`
that contradicts the bytes is an error. Every check that needs no decoding (type, byte size, counts) runs before
any pixel or sample is decoded, and durations are measured by decoding (frames / fps, samples / rate). Every
violation raises a `MediaError` subclass naming the file, the field and the limit; no PIL or PyAV exception
escapes.

Decoding follows diffusers' `MiniMaxH3*Reference.from_file`: PIL with EXIF orientation then `convert("RGB")`
for images; PyAV for video (rgb24 frames, fps from the stream's average rate) and audio (float32 planar at the
native rate). Deliberate differences: a video's display rotation is applied the way the ffmpeg CLI shows it
(diffusers rotates 90/270-degree videos the opposite way), a soundtrack with more than two channels is downmixed to
stereo (diffusers would reject it later), and a soundtrack is cut at the clip limit.

One loader per kind (`image_intake`, `audio_intake`, `video_intake`, sharing `media_checks` and `media_errors`);
this module picks the loader from the bytes and applies the Ref2VA reference set's rules.
"""

from __future__ import annotations

from collections.abc import Sequence

from h3serve.media.audio_intake import AudioMedia, load_audio, resample_audio
from h3serve.media.image_intake import ImageMedia, load_image
from h3serve.media.media_checks import MAX_BYTES, inspect_file
from h3serve.media.media_errors import (
    MediaDecodeError,
    MediaError,
    MediaFormatError,
    MediaLimitError,
    ReferenceSetError,
)
from h3serve.media.sniff import sniff
from h3serve.media.video_intake import FrameReducer, ReduceVideo, VideoMedia, load_video
from h3serve.rules import limits
from h3serve.rules.request import MediaRef

__all__ = [
    "MAX_BYTES",
    "AudioMedia",
    "FrameReducer",
    "ImageMedia",
    "Media",
    "MediaDecodeError",
    "MediaError",
    "MediaFormatError",
    "MediaLimitError",
    "ReduceVideo",
    "ReferenceSetError",
    "VideoMedia",
    "load_audio",
    "load_image",
    "load_media",
    "load_references",
    "load_video",
    "resample_audio",
    "sniff",
]

Media = ImageMedia | VideoMedia | AudioMedia


_LOADERS = {"image": load_image, "video": load_video, "audio": load_audio}


def load_media(ref: MediaRef, field: str) -> Media:
    """Decode any accepted file, choosing the loader from its bytes; `ref.kind`, if set, must agree with them."""
    return _LOADERS[inspect_file(ref, field, None).kind](ref, field)


def check_references(refs: Sequence[MediaRef], start_times: Sequence[float] = ()) -> None:
    """Apply every rule of `load_references` without keeping decoded video frames (for request validation:
    a server checks each request's media before queueing it, and must not hold GiBs of frames to do so)."""
    load_references(refs, keep_frames=False, start_times=start_times)


def load_references(
    refs: Sequence[MediaRef],
    keep_frames: bool = True,
    reduce_video: ReduceVideo | None = None,
    start_times: Sequence[float] = (),
) -> list[Media]:
    """Decode a Ref2VA reference set, in order, with the set rules applied (fields "references[i]").

    Rules: at most 9 images, 3 videos, 3 audio clips and 12 files; audio needs at least one image or video;
    video clips and audio clips each last 2-15 s and at most 15 s together per modality (a video's soundtrack is
    part of the video and counts towards neither audio limit). Counts, types and byte sizes are checked for the
    whole set before anything is decoded. `start_times` trims the video references: one value for all, or one
    per video reference in order (ref2va `start_time_seconds`); the duration rules apply to what remains.
    """
    fields = [f"references[{i}]" for i in range(len(refs))]
    if len(refs) > limits.MAX_MEDIA_FILES:
        i = limits.MAX_MEDIA_FILES
        raise ReferenceSetError(
            refs[i].name, fields[i], f"{len(refs)} reference files", f"at most {limits.MAX_MEDIA_FILES} files"
        )
    kinds = [inspect_file(ref, field, None).kind for ref, field in zip(refs, fields, strict=True)]
    caps = {"image": limits.REF_MAX_IMAGES, "video": limits.REF_MAX_VIDEOS, "audio": limits.REF_MAX_AUDIOS}
    for i, kind in enumerate(kinds):
        if (count := kinds[: i + 1].count(kind)) > caps[kind]:
            raise ReferenceSetError(
                refs[i].name, fields[i], f"{kind} reference number {count}", f"at most {caps[kind]} {kind} references"
            )
    if kinds and set(kinds) == {"audio"}:
        raise ReferenceSetError(
            refs[0].name, fields[0], "only audio references", "audio references need at least one image or video"
        )

    videos = kinds.count("video")
    if len(start_times) > 1 and len(start_times) != videos:
        raise ReferenceSetError(
            refs[0].name,
            "start_time_seconds",
            f"{len(start_times)} start times for {videos} video references",
            "one start time, or one per video reference",
        )
    starts = iter(list(start_times) * videos if len(start_times) == 1 else start_times)
    media: list[Media] = []
    totals = {"video": 0.0, "audio": 0.0}
    for ref, field, kind in zip(refs, fields, kinds, strict=True):
        if kind == "video":
            item = load_video(ref, field, keep_frames, reduce_video, next(starts, 0.0))
        else:
            item = _LOADERS[kind](ref, field)
        if isinstance(item, VideoMedia | AudioMedia):
            totals[kind] += item.duration_s
            if totals[kind] > limits.REF_TOTAL_MAX_S + limits.MEDIA_DURATION_SLACK_S:
                raise ReferenceSetError(
                    ref.name,
                    field,
                    f"{kind} references add up to {totals[kind]:.2f} s",
                    f"at most {limits.REF_TOTAL_MAX_S:g} s of {kind} references in total",
                )
        media.append(item)
    return media
