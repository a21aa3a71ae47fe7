"""Timeline guide rules (h3serve/rules/guides.py): placement, the row arithmetic against the reference note's worked
figures, the manifest and its uploads, the limits, and every combination that is refused, each a RequestError naming
the entry and the rule."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from h3serve.rules import geometry
from h3serve.rules.guide_limits import GuideLimits
from h3serve.rules.guides import (
    GuideProbe,
    PlacedGuide,
    attention_refusal,
    check_uploads,
    guide_audio_latents,
    guide_rows,
    padded_rows,
    parse_manifest,
    target_rows,
    visual_guide_frames,
)
from h3serve.rules.request import GenerationRequest, MediaRef, TimelineGuide
from h3serve.rules.schedule import PinnedSchedule
from h3serve.rules.validate import ModelDefaults, RequestError, validate

IMAGE = MediaRef(Path("g.png"), "g.png", "image")
CLIP = MediaRef(Path("g.mp4"), "g.mp4", "video")
SOUND = MediaRef(Path("g.wav"), "g.wav", "audio")
IMAGE_PROBE = GuideProbe(visual_frames=1, source_frames=1, source_pixels=256 * 256)
SOUND_PROBE = GuideProbe(audio_samples=64_000, audio_latents=80)  # 2 s at 32 kHz


def clip_probe(frames: int) -> GuideProbe:
    return GuideProbe(visual_frames=frames, source_frames=frames, source_pixels=320 * 192)


def plan(guides, probes, defaults: ModelDefaults = ModelDefaults(), **fields):  # noqa: B008 (frozen)
    fields.setdefault("duration_s", 5)  # 124 frames
    request = GenerationRequest(prompt="a cat", guides=tuple(guides), **fields)
    return validate(request, defaults, guide_probes=tuple(probes))


def refused(field: str, guides, probes, defaults: ModelDefaults = ModelDefaults(), **fields) -> str:  # noqa: B008
    with pytest.raises(RequestError) as e:
        plan(guides, probes, defaults, **fields)
    assert e.value.field == field, str(e.value)
    return e.value.message


@pytest.mark.parametrize("m, g", [(1, 1), (4, 1), (5, 5), (21, 5), (22, 22), (38, 22), (39, 39), (124, 124)])
def test_a_clip_keeps_1_or_5_plus_17k_frames(m, g):
    assert visual_guide_frames(m) == g


def test_starts_count_from_either_end_and_are_never_rounded():
    placed = plan(
        [TimelineGuide(36, IMAGE), TimelineGuide(-1, IMAGE), TimelineGuide(-22, CLIP), TimelineGuide(7, audio=SOUND)],
        [IMAGE_PROBE, IMAGE_PROBE, clip_probe(22), SOUND_PROBE],
    ).guides
    assert [(g.start, g.frames, g.latent_frames) for g in placed] == [(36, 1, 1), (123, 1, 1), (102, 22, 7), (7, 0, 0)]


def test_guides_must_fit_the_output_and_are_not_retrimmed():
    """The note's example: 22 frames at -22 fit N = 124; at -1 they would need frames 123..144."""
    assert plan([TimelineGuide(-22, CLIP)], [clip_probe(22)]).guides[0].start == 102
    message = refused("timeline_guides[0].frame_index", [TimelineGuide(-1, CLIP)], [clip_probe(22)])
    assert "123..144" in message and "start + 22 <= 124" in message
    refused("timeline_guides[0].frame_index", [TimelineGuide(124, IMAGE)], [IMAGE_PROBE])
    refused("timeline_guides[1].frame_index", [TimelineGuide(0, IMAGE), TimelineGuide(-125, IMAGE)],
            [IMAGE_PROBE, IMAGE_PROBE])
    assert plan([TimelineGuide(-124, IMAGE)], [IMAGE_PROBE]).guides[0].start == 0


def test_a_sound_is_cropped_to_the_latents_left_after_its_frame():
    # N = 124: A = (5·124 + 1) // 3 = 207 latents per channel, L = (3A - 5·start) // 3
    assert geometry.audio_latents(124) == (5 * 124 + 1) // 3 == 207
    assert guide_audio_latents(0, 124) == 207
    assert guide_audio_latents(36, 124) == (621 - 180) // 3 == 147
    assert guide_audio_latents(123, 124) == (621 - 615) // 3 == 2
    long_sound = dataclasses.replace(SOUND_PROBE, audio_latents=600)
    assert plan([TimelineGuide(36, audio=SOUND)], [long_sound]).guides[0].audio_latents == 147
    assert plan([TimelineGuide(36, audio=SOUND)], [SOUND_PROBE]).guides[0].audio_latents == 80  # shorter: all of it
    assert plan([TimelineGuide(-1, audio=SOUND)], [SOUND_PROBE]).guides[0].audio_latents == 2  # a 1-frame bound
    av = plan([TimelineGuide(-5, CLIP, SOUND)], [dataclasses.replace(clip_probe(5), audio_latents=80)]).guides[0]
    assert (av.start, av.frames, av.audio_latents) == (119, 5, (621 - 595) // 3)


def test_rows_match_the_reference_notes_worked_figures():
    """1344x768, 124 frames, 256 text rows: four images 4,032 guide / 42,048 packed rows; a 22-frame clip 7,056 /
    45,056 (packed rows padded to 64), counted here from the geometry."""
    lh, lw = 768 // 16, 1344 // 16
    per_frame = (768 // 32) * (1344 // 32)
    assert per_frame == 1008
    images = [PlacedGuide(start, 1, IMAGE) for start in (0, 36, 72, 123)]
    clip = [PlacedGuide(102, 22, CLIP)]
    assert guide_rows(images, lh, lw) == 4 * per_frame == 4032
    assert guide_rows(clip, lh, lw) == 7 * per_frame == 7056
    targets = 37 * per_frame + 2 * 207
    assert target_rows(124, lh, lw) == targets == 37_710
    assert padded_rows(256 + 4032 + targets) == 42_048
    assert padded_rows(256 + 7056 + targets) == 45_056
    assert guide_rows([PlacedGuide(36, 0, audio=SOUND, audio_latents=147)], lh, lw) == 294  # 2 channels


# -- the manifest (HTTP) ----------------------------------------------------------------------------------------------


def test_a_manifest_entry_is_a_frame_and_one_or_two_sources():
    entries = parse_manifest([
        {"frame_index": -22, "video": {"upload_index": 0}, "audio": {"upload_index": 1}},
        {"frame_index": 36, "image": {"url": "https://example.com/a.png"}},
    ])
    assert entries[0].frame_index == -22
    assert [(s.kind, s.upload_index) for s in entries[0].sources] == [("video", 0), ("audio", 1)]
    assert entries[1].sources[0].url == "https://example.com/a.png"
    assert parse_manifest([]) == ()


MANIFEST_REFUSALS = [
    ({"frame_index": True, "image": {"upload_index": 0}}, "timeline_guides[0].frame_index", "must be an integer"),
    ({"frame_index": 1.0, "image": {"upload_index": 0}}, "timeline_guides[0].frame_index", "must be an integer"),
    ({"frame_index": "3", "image": {"upload_index": 0}}, "timeline_guides[0].frame_index", "must be an integer"),
    ({"image": {"upload_index": 0}}, "timeline_guides[0].frame_index", "is required"),
    ({"frame_index": 3}, "timeline_guides[0]", "at least one source"),
    ({"frame_index": 3, "image": {"upload_index": 0}, "video": {"upload_index": 1}}, "timeline_guides[0]",
     "not both"),
    ({"frame_index": 3, "image": {"upload_index": 0}, "strength": 0.5}, "timeline_guides[0].strength",
     "unknown field"),
    ({"frame_index": 3, "image": {"upload_index": -1}}, "timeline_guides[0].image.upload_index", ">= 0"),
    ({"frame_index": 3, "image": {"upload_index": False}}, "timeline_guides[0].image.upload_index", "integer"),
    ({"frame_index": 3, "image": {"upload_index": 0, "url": "x"}}, "timeline_guides[0].image", "exactly one"),
    ({"frame_index": 3, "image": {"path": "/etc/passwd"}}, "timeline_guides[0].image", "unknown field"),
    ({"frame_index": 3, "audio": "a.wav"}, "timeline_guides[0].audio", "must be an object"),
    ("not an object", "timeline_guides[0]", "must be an object"),
]


@pytest.mark.parametrize("entry, field, phrase", MANIFEST_REFUSALS)
def test_the_manifest_refusals_name_the_entry_and_the_rule(entry, field, phrase):
    with pytest.raises(RequestError) as e:
        parse_manifest([entry])
    assert e.value.field == field and phrase in e.value.message


def test_a_manifest_is_a_list_of_at_most_max_entries():
    with pytest.raises(RequestError, match="must be a JSON list"):
        parse_manifest({"frame_index": 0})
    entry = {"frame_index": 0, "image": {"upload_index": 0}}
    with pytest.raises(RequestError) as e:
        parse_manifest([entry] * 3, max_entries=2)
    assert e.value.field == "timeline_guides[2]" and "at most 2" in e.value.message


def test_uploads_must_all_be_used_in_range_of_their_kind_and_one_kind_each():
    image0 = {"frame_index": 0, "image": {"upload_index": 0}}
    entries = parse_manifest([image0, {"frame_index": 9, "image": {"upload_index": 0}}])
    check_uploads(entries, ["image"])  # one upload, two entries of the same kind: fine

    def refused_uploads(manifest, kinds) -> tuple[str, str]:
        with pytest.raises(RequestError) as e:
            check_uploads(parse_manifest(manifest), kinds)
        return e.value.field, e.value.message

    field, message = refused_uploads([{"frame_index": 0, "image": {"upload_index": 2}}], ["image", "image"])
    assert field == "timeline_guides[0].image.upload_index" and "does not exist" in message
    field, message = refused_uploads([image0], ["image", "audio"])
    assert field == "guide_files[1]" and "not referenced" in message
    field, message = refused_uploads([{"frame_index": 0, "video": {"upload_index": 0}}], ["image"])
    assert field == "timeline_guides[0].video.upload_index" and "is an image file, not a video" in message
    field, message = refused_uploads([image0, {"frame_index": 5, "audio": {"upload_index": 0}}], [None])
    assert field == "timeline_guides[1].audio.upload_index" and "one upload serves one kind" in message


# -- limits -----------------------------------------------------------------------------------------------------------


def test_server_limits_are_strict_positive_integers_of_known_keys():
    assert GuideLimits.from_json({}) == GuideLimits()
    assert GuideLimits.from_json({"max_entries": 2}).max_entries == 2
    for bad, phrase in [({"max_entries": 0}, "positive"), ({"max_entries": True}, "positive"),
                        ({"max_entries": 2.0}, "positive"), ({"max_entrys": 2}, "unknown key"),
                        ({"subprocess_timeout_seconds": 60}, "not used"), ([], "JSON object")]:
        with pytest.raises(ValueError, match=phrase):
            GuideLimits.from_json(bad)


def test_limits_on_entries_rows_and_decoding_work():
    defaults = ModelDefaults(guide_limits=GuideLimits(max_entries=1))
    message = refused("timeline_guides[1]", [TimelineGuide(0, IMAGE)] * 2, [IMAGE_PROBE] * 2, defaults)
    assert "at most 1" in message
    # 768x1344 canvas (16:9 default): one image is 1,008 rows
    rows = ModelDefaults(guide_limits=GuideLimits(max_guide_rows=1007))
    assert "1,008 rows" in refused("timeline_guides", [TimelineGuide(0, IMAGE)], [IMAGE_PROBE], rows)
    first = MediaRef(Path("k.png"), "k.png", "image")  # an FL2VA keyframe counts as guide rows (vLLM-Omni's anchors)
    rows = ModelDefaults(guide_limits=GuideLimits(max_guide_rows=2015))
    message = refused("timeline_guides", [TimelineGuide(0, IMAGE)], [IMAGE_PROBE], rows, image=first)
    assert "guides and keyframes add 2,016 rows" in message
    packed = ModelDefaults(guide_limits=GuideLimits(max_packed_rows=37_710 + 1008))  # 38,718: padded to 38,720
    assert "pack into 38,720 rows" in refused("timeline_guides", [TimelineGuide(0, IMAGE)], [IMAGE_PROBE], packed)
    work = ModelDefaults(guide_limits=GuideLimits(max_decoded_visual_pixels=22 * 1344 * 768 - 1))
    assert "decode to" in refused("timeline_guides", [TimelineGuide(0, CLIP)], [clip_probe(22)], work)
    samples = ModelDefaults(guide_limits=GuideLimits(max_decoded_audio_samples=100_000))
    message = refused("timeline_guides", [TimelineGuide(0, audio=SOUND)] * 2, [SOUND_PROBE] * 2, samples)
    assert "128,000 samples" in message  # counted once per entry, a reused file too


# -- combinations: served, or refused with the reason -----------------------------------------------------------------


GUIDE, PROBE = [TimelineGuide(36, IMAGE)], [IMAGE_PROBE]


def test_guides_compose_with_keyframes_references_long_video_and_several_outputs():
    first = MediaRef(Path("k.png"), "k.png", "image")
    assert plan(GUIDE, PROBE, image=first, last_image=first).task == "fl2va"
    assert plan(GUIDE, PROBE, references=(first,)).task == "ref2va"
    assert plan(GUIDE, PROBE).task == "t2va"  # text plus guides
    assert plan(GUIDE, PROBE, quality="lossless").guides
    assert plan(GUIDE, PROBE, num_outputs=3).num_outputs == 3
    assert plan(GUIDE, PROBE, long_video=True, long_video_mode="full").guides


def test_refused_combinations_name_the_reason():
    assert "quality=lossless" in refused("timeline_guides", GUIDE, PROBE, quality="high")
    cache = ModelDefaults(server_cache="cache_dit")
    assert "--cache-backend cache_dit" in refused("timeline_guides", GUIDE, PROBE, cache)
    assert plan(GUIDE, PROBE, cache, quality="lossless").guides  # what the message asks for
    pinned = ModelDefaults(pinned_schedule=PinnedSchedule(owner="the Turbo LoRA t.safetensors", steps=4,
                                                          flow_shift=5.0))
    assert "distilled" in refused("timeline_guides", GUIDE, PROBE, pinned)
    sparse = ModelDefaults(guide_refusal=attention_refusal("FASTVIDEO_VSA"))
    assert "not dense" in refused("timeline_guides", GUIDE, PROBE, sparse)
    assert attention_refusal("TORCH_SDPA") is None and attention_refusal("FLASH_ATTN") is None
    message = refused("timeline_guides", GUIDE, PROBE, references=(IMAGE,), long_video=True, duration_s=20,
                      long_video_mode="continuation")
    assert "continuation" in message
    source = MediaRef(Path("s.mp4"), "s.mp4", "video")
    assert "latent-mask edit" in refused("timeline_guides", GUIDE, PROBE, source_video=source, video_noise_mask=0.5)


def test_the_intake_must_have_measured_every_guide():
    assert "not measured" in refused("timeline_guides", GUIDE, [])


def test_the_model_card_states_whether_guides_are_served_and_their_limits():
    from h3serve.rules.guides import guide_capability

    card = guide_capability(ModelDefaults(guide_limits=GuideLimits(max_entries=3)))
    assert card["served"] is True and card["limits"]["max_entries"] == 3 and "reason" not in card
    assert card["fields"] == {"manifest": "timeline_guides", "files": "guide_files", "sources": ["upload_index", "url"]}
    sparse = guide_capability(ModelDefaults(guide_refusal=attention_refusal("FASTVIDEO_VSA"), server_cache="x"))
    assert sparse["served"] is False and "not dense" in sparse["reason"] and "lossless" in sparse["quality"]
