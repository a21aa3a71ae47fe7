"""Timeline guides: an image, a clip or a sound placed at any output frame, counted from the start or the end
(vLLM-Omni's `timeline_guides`; reference note `vllm_omni_033_guides_cache_adapters.md` §1). No torch here.

The request: a manifest of entries `{"frame_index": int, "image" | "video" | "audio": {"upload_index": int} |
{"url": str}}` (at least one source; image and video never together), the files uploaded as repeated `guide_files`.

The rules, for an output of N frames (17n + 5) and A = audio latents per channel:
- start = i for i >= 0, else N + i; never rounded to a VAE boundary.
- A clip of M frames (24 fps) keeps G = 1 frame for M in 1..4, else 5 + 17·floor((M - 5) / 17); an image is G = 1.
  The guide must fit: 0 <= start and start + G <= N (an audio-only entry: start + 1 <= N). Nothing is re-trimmed.
- A sound starts at the guide's frame and is cropped to L = floor((3A - 5·start) / 3) latents per channel (L >= 1):
  the latents from that frame to the end of the output.
- Packing (h3serve.model.layout): guides are condition prefixes right after the text, in entry order (an entry's
  picture before its sound), before FL2VA keyframes and Ref2VA references. A guide's RoPE time origin is
  T0 + (5/3)·start, T0 = the targets' origin (the text length; in Ref2VA the clock after the references), the
  fraction kept; guides do not move T0. Visual rows: near clean (t = max(t, 0.999)); audio rows: clean (t = 1).

Every refusal is a `RequestError` naming the entry (`timeline_guides[i]`) and the rule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from h3serve.errors import RequestError
from h3serve.rules import geometry, limits
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.guide_limits import GuideLimits
from h3serve.rules.request import MediaKind, MediaRef, TimelineGuide

FIELD = "timeline_guides"
GuideKind = Literal["image", "video", "audio"]
GUIDE_KINDS: tuple[GuideKind, ...] = get_args(GuideKind)
VISUAL_KINDS = ("image", "video")
SOURCE_KEYS = ("upload_index", "url")
# Attention backends that compute dense attention over every row: guides are served on these only (a sparse
# backend picks the tiles a query reads from the targets' own statistics and may drop a guide's tiles).
DENSE_ATTENTION_BACKENDS = ("TORCH_SDPA", "FLASH_ATTN", "CUDNN_ATTN", "FLASHINFER_ATTN")


def entry_field(index: int, part: str = "") -> str:
    """How an error names a manifest entry (and one of its parts): timeline_guides[2].frame_index."""
    return f"{FIELD}[{index}]{'.' + part if part else ''}"


# ---------------------------------------------------------------------------------------------------------------
# The manifest (HTTP): entries whose sources are uploads (by index) or URLs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GuideSource:
    """Where one source of an entry comes from: the `upload_index`-th `guide_files` upload, or a URL."""

    kind: GuideKind
    upload_index: int | None = None
    url: str | None = None


@dataclass(frozen=True)
class ManifestEntry:
    frame_index: int
    sources: tuple[GuideSource, ...]  # a picture (image or video) first, then a sound


def _strict_int(value: object, field: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(field, f"{what} must be an integer (not a bool, float or string), got {value!r}")
    return value


def _source(kind: GuideKind, value: object, field: str) -> GuideSource:
    if not isinstance(value, Mapping):
        raise RequestError(field, f'must be an object, {{"upload_index": N}} or {{"url": "..."}}, got {value!r}')
    unknown = sorted(set(value) - set(SOURCE_KEYS))
    if unknown:
        raise RequestError(field, f"unknown field {unknown[0]!r}; a source has upload_index or url")
    if len(value) != 1:
        raise RequestError(field, "needs exactly one of upload_index or url")
    if "url" in value:
        url = value["url"]
        if not isinstance(url, str) or not url.strip():
            raise RequestError(f"{field}.url", f"must be a non-empty string, got {url!r}")
        return GuideSource(kind, url=url.strip())
    index = _strict_int(value["upload_index"], f"{field}.upload_index", "upload_index")
    if index < 0:
        raise RequestError(f"{field}.upload_index", f"must be >= 0, got {index}")
    return GuideSource(kind, upload_index=index)


def parse_manifest(value: object, max_entries: int = limits.GUIDE_MAX_ENTRIES) -> tuple[ManifestEntry, ...]:
    """The manifest's entries, each checked for shape: a list of objects with a strict-int `frame_index` and one or
    two sources (image | video, audio; image and video never together); unknown fields refused."""
    if not isinstance(value, list):
        raise RequestError(FIELD, f"must be a JSON list of guide entries, got {type(value).__name__}")
    if len(value) > max_entries:
        raise RequestError(entry_field(max_entries), f"{len(value)} guides; this server takes at most {max_entries}")
    entries = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise RequestError(entry_field(i), f"must be an object, got {type(item).__name__}")
        unknown = sorted(set(item) - {"frame_index", *GUIDE_KINDS})
        if unknown:
            raise RequestError(
                entry_field(i, unknown[0]),
                "unknown field; an entry has frame_index and image, video and/or audio (no strength, mask or "
                "negative conditioning: a negative frame_index counts from the end)",
            )
        if "frame_index" not in item:
            raise RequestError(entry_field(i, "frame_index"), "is required")
        frame_index = _strict_int(item["frame_index"], entry_field(i, "frame_index"), "frame_index")
        kinds = [k for k in GUIDE_KINDS if k in item]
        if not kinds:
            raise RequestError(entry_field(i), "needs at least one source: image, video or audio")
        if "image" in kinds and "video" in kinds:
            raise RequestError(entry_field(i), "takes an image or a video, not both")
        sources = tuple(_source(k, item[k], entry_field(i, k)) for k in kinds)  # GUIDE_KINDS order: picture first
        entries.append(ManifestEntry(frame_index, sources))
    return tuple(entries)


def _article(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def check_uploads(entries: Sequence[ManifestEntry], upload_kinds: Sequence[MediaKind | None]) -> None:
    """The uploads against the manifest: every index in range, every upload used, each of the kind its entry says
    (from its bytes; None: unrecognised, left to the media intake), and no upload used as two kinds."""
    used_as: dict[int, tuple[str, str]] = {}  # upload -> (kind, the first field using it)
    for i, entry in enumerate(entries):
        for source in entry.sources:
            if source.upload_index is None:
                continue
            field = entry_field(i, f"{source.kind}.upload_index")
            index = source.upload_index
            if index >= len(upload_kinds):
                count = len(upload_kinds)
                raise RequestError(field, f"upload {index} does not exist ({count} guide_files upload"
                                          f"{'' if count == 1 else 's'}, numbered from 0)")
            kind = upload_kinds[index]
            if kind is not None and kind != source.kind:
                raise RequestError(field, f"upload {index} is {_article(kind)} file, not {_article(source.kind)}")
            first = used_as.setdefault(index, (source.kind, field))
            if first[0] != source.kind:
                raise RequestError(field, f"upload {index} is used as {_article(first[0])} by {first[1]}; one upload "
                                          "serves one kind")
    unused = [i for i in range(len(upload_kinds)) if i not in used_as]
    if unused:
        raise RequestError(f"guide_files[{unused[0]}]", "is not referenced by any timeline_guides entry")


# ---------------------------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------------------------


def visual_guide_frames(decoded_frames: int) -> int:
    """G, the frames a visual guide keeps of M decoded (24 fps) frames: 1 for 1-4, else 5 + 17·floor((M - 5)/17)."""
    if decoded_frames < 1:
        raise ValueError("a visual guide has at least one frame")
    block, rest = limits.VAE_FRAMES_PER_CHUNK, limits.VAE_LATENTS_PER_CHUNK
    if decoded_frames < rest:
        return 1
    return rest + block * ((decoded_frames - rest) // block)


def guide_latent_frames(frames: int) -> int:
    """Latent frames of a visual guide of G frames (1 or 17k + 5): 1, or 5k + 2."""
    return 1 if frames == 1 else geometry.latent_frames(frames)


def guide_start(frame_index: int, num_frames: int) -> int:
    """The output frame a guide starts at: `frame_index` from the start, or (negative) from the end."""
    return frame_index if frame_index >= 0 else num_frames + frame_index


def guide_audio_latents(start: int, num_frames: int) -> int:
    """L: audio latents per channel from frame `start` to the end of an output of `num_frames` frames."""
    return (3 * geometry.audio_latents(num_frames) - 5 * start) // 3


def guide_time_offset(start: int) -> float:
    """A guide's RoPE time after the targets' origin: (5/3)·start, one rotary unit per audio latent (1/40 s)."""
    return 5.0 * start / 3.0


@dataclass(frozen=True)
class GuideProbe:
    """What the media intake measured of one entry's files before the request is queued (no pixel kept)."""

    visual_frames: int = 0  # M: 24 fps frames of a clip (its held frames), 1 for an image, 0 without a picture
    source_frames: int = 0  # frames the clip's file holds (1 for an image)
    source_pixels: int = 0  # width x height of the picture as decoded
    audio_samples: int = 0  # per channel, at the source rate (0 without a sound)
    audio_latents: int = 0  # the sound at 32 kHz in audio latents (800 samples each), before the crop to L


@dataclass(frozen=True)
class PlacedGuide:
    """A checked guide, placed on the output's frames: what the pipeline encodes and packs."""

    start: int  # output frame of its first frame
    frames: int  # G visual frames kept (0: no picture)
    visual: MediaRef | None = None  # kind "image" or "video"
    audio: MediaRef | None = None
    audio_latents: int = 0  # latents per channel packed: min(the sound's, L); 0 without a sound

    @property
    def latent_frames(self) -> int:
        return guide_latent_frames(self.frames) if self.frames else 0


def guide_rows(guides: Sequence[PlacedGuide], latent_h: int, latent_w: int) -> int:
    """Rows the guides add: latent frames x (h/2)(w/2) visual rows, 2 x latents audio rows."""
    per_frame = (latent_h // 2) * (latent_w // 2)
    return sum(g.latent_frames * per_frame + limits.AUDIO_CHANNELS * g.audio_latents for g in guides)


def padded_rows(rows: int) -> int:
    """Rows as vLLM-Omni counts them against max_packed_rows: padded to a multiple of 64."""
    multiple = limits.GUIDE_PACKED_ROW_MULTIPLE
    return multiple * math.ceil(rows / multiple)


def target_rows(num_frames: int, latent_h: int, latent_w: int) -> int:
    """The generated rows: video latent frames x (h/2)(w/2), plus both channels' audio latents."""
    per_frame = (latent_h // 2) * (latent_w // 2)
    return geometry.latent_frames(num_frames) * per_frame + limits.AUDIO_CHANNELS * geometry.audio_latents(num_frames)


# ---------------------------------------------------------------------------------------------------------------
# Validation: combinations, placement, limits
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GuideContext:
    """What the guide rules read of the rest of a request and of the server (validate fills it in)."""

    num_frames: int
    latent_h: int
    latent_w: int
    keyframes: int = 0  # FL2VA keyframes (one latent frame each on the canvas)
    quality: str | None = None
    cache: str | None = None  # the DiT cache the request runs under (quality=high, or the server's when omitted)
    pinned_owner: str | None = None  # who pins a distilled schedule (a Turbo / PDD LoRA, a fused FastH3 adapter)
    refusal: str | None = None  # why this server serves no guides at all (e.g. a sparse attention backend)
    other: str | None = None  # a request feature guides do not compose with: its field and why


def combination_refusal(ctx: GuideContext) -> str | None:
    """Why guides cannot run with the rest of this request or on this server (None: they can)."""
    if ctx.refusal is not None:
        return f"this server serves no timeline guides: {ctx.refusal}"
    if ctx.other is not None:
        return ctx.other
    if ctx.cache is not None:
        server = f"this server's --cache-backend {ctx.cache}, quality omitted"
        cache = "quality=high" if ctx.quality == "high" else server
        return (
            f"guides do not run under a DiT cache ({cache}): the cache decides to skip blocks from the mean change of "
            "every row, and guide rows, held near clean at every step, dilute that signal; send quality=lossless"
        )
    if ctx.pinned_owner is not None:
        return (
            f"{ctx.pinned_owner} pins a distilled few-step schedule whose student was never trained with mid-clip "
            "condition rows; send the request without that adapter"
        )
    return None


def attention_refusal(backend: str) -> str | None:
    """Why guides cannot run on the self-attention backend `backend` (None: a dense one)."""
    if backend in DENSE_ATTENTION_BACKENDS:
        return None
    return (
        f"its self-attention backend {backend} is not dense (guides run on {', '.join(DENSE_ATTENTION_BACKENDS)}): a "
        "sparse backend keeps the tiles the targets' own scores pick and may drop a guide's rows"
    )


def place_guides(
    guides: Sequence[TimelineGuide], probes: Sequence[GuideProbe], ctx: GuideContext, guide_limits: GuideLimits
) -> tuple[PlacedGuide, ...]:
    """Check every rule and place each guide on the output's frames (`probes`: the intake's measurements, one per
    guide). Raises `RequestError` naming the entry and the rule."""
    if not guides:
        return ()
    why = combination_refusal(ctx)
    if why is not None:
        raise RequestError(FIELD, why)
    if len(guides) > guide_limits.max_entries:
        raise RequestError(entry_field(guide_limits.max_entries),
                           f"{len(guides)} guides; this server takes at most {guide_limits.max_entries}")
    if len(probes) != len(guides):
        raise RequestError(FIELD, "the guides' media were not measured")
    n = ctx.num_frames
    placed = []
    canvas = ctx.latent_h * ctx.latent_w * limits.VAE_SPATIAL_COMPRESSION**2
    visual_work = audio_work = 0
    for i, (guide, probe) in enumerate(zip(guides, probes, strict=True)):
        if guide.visual is None and guide.audio is None:
            raise RequestError(entry_field(i), "needs at least one source: image, video or audio")
        if guide.visual is not None and guide.visual.kind not in VISUAL_KINDS:
            raise RequestError(entry_field(i), f"a picture is an image or a video, got {guide.visual.kind!r}")
        part = "frame_index"
        index = _strict_int(guide.frame_index, entry_field(i, part), "frame_index")
        start = guide_start(index, n)
        frames = 0
        if guide.visual is not None:
            if probe.visual_frames < 1:
                raise RequestError(entry_field(i, guide.visual.kind or "video"), "decodes to no frames")
            frames = visual_guide_frames(probe.visual_frames)
        span = frames or 1  # an audio-only entry is bound like one frame
        if start < 0 or start + span > n:
            what = f"a {frames}-frame picture" if frames else "a sound (bound as one frame)"
            raise RequestError(
                entry_field(i, part),
                f"{index} places {what} at frames {start}..{start + span - 1}, outside the output's frames "
                f"0..{n - 1}: frame_index must satisfy 0 <= start and start + {span} <= {n} (start = frame_index, "
                f"or {n} + frame_index when negative; guides are not re-trimmed)",
            )
        audio_latents = 0
        if guide.audio is not None:
            room = guide_audio_latents(start, n)
            if room < 1:
                raise RequestError(entry_field(i, part), f"a sound from frame {start} leaves no audio latent before "
                                                         "the end of the output")
            if probe.audio_latents < 1:
                raise RequestError(entry_field(i, "audio"), "decodes to no audio samples")
            audio_latents = min(room, probe.audio_latents)
        visual_work += max(probe.source_frames, probe.visual_frames) * max(probe.source_pixels, canvas) if frames else 0
        audio_work += probe.audio_samples
        placed.append(PlacedGuide(start, frames, guide.visual, guide.audio, audio_latents))
    if visual_work > guide_limits.max_decoded_visual_pixels:
        raise RequestError(FIELD, f"the visual guides decode to {visual_work:,} pixels (frames x max(source, canvas) "
                                  f"pixels); the limit is {guide_limits.max_decoded_visual_pixels:,}")
    if audio_work > guide_limits.max_decoded_audio_samples:
        raise RequestError(FIELD, f"the audio guides decode to {audio_work:,} samples per channel; the limit is "
                                  f"{guide_limits.max_decoded_audio_samples:,}")
    _check_rows(tuple(placed), ctx, guide_limits)
    return tuple(placed)


def _check_rows(placed: tuple[PlacedGuide, ...], ctx: GuideContext, guide_limits: GuideLimits) -> None:
    """The row limits: FL2VA keyframes count as guide rows beside guides (as vLLM-Omni counts its adapted anchors)."""
    keyframe_rows = ctx.keyframes * (ctx.latent_h // 2) * (ctx.latent_w // 2)
    rows = guide_rows(placed, ctx.latent_h, ctx.latent_w) + keyframe_rows
    if rows > guide_limits.max_guide_rows:
        raise RequestError(FIELD, f"the guides{' and keyframes' if keyframe_rows else ''} add {rows:,} rows; the "
                                  f"limit is {guide_limits.max_guide_rows:,} (fewer or shorter guides, or a smaller "
                                  "canvas)")
    packed = padded_rows(rows + target_rows(ctx.num_frames, ctx.latent_h, ctx.latent_w))
    if packed > guide_limits.max_packed_rows:
        raise RequestError(FIELD, f"guides, keyframes and targets pack into {packed:,} rows; the limit is "
                                  f"{guide_limits.max_packed_rows:,}")


def guide_capability(defaults: ModelDefaults) -> dict[str, object]:
    """Timeline guides on a server, as its `GET /v1/models` card states them: whether they are served (and why not),
    the request's fields, the limits, and what a request may not combine them with."""
    pin = defaults.pinned_schedule
    reason = defaults.guide_refusal
    if reason is None and pin is not None:  # every request of this server runs the pinned schedule
        reason = f"{pin.owner} pins a distilled schedule (never trained with mid-clip condition rows)"
    card: dict[str, object] = {
        "served": reason is None,
        "fields": {"manifest": FIELD, "files": "guide_files", "sources": list(SOURCE_KEYS)},
        "kinds": list(GUIDE_KINDS),
        "limits": dataclasses.asdict(defaults.guide_limits),
        "not_with": ["quality=high", "a distilled (pinned) schedule", "long_video_mode=continuation",
                     "latent-mask edits", "control videos"],
    }
    if reason is not None:
        card["reason"] = reason
    if defaults.server_cache is not None:
        card["quality"] = f"lossless (this server's --cache-backend {defaults.server_cache} runs when it is omitted)"
    return card
