"""Media intake: every limit at and past its edge, corrupt and mislabelled files, valid files of every type.

All media are generated here (PIL, pillow-heif, the ffmpeg CLI) once per module, small and short.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from h3serve.media import media_inputs as intake
from h3serve.media.media_inputs import (
    AudioMedia,
    ImageMedia,
    MediaDecodeError,
    MediaFormatError,
    MediaLimitError,
    ReferenceSetError,
    VideoMedia,
)
from h3serve.rules import limits
from h3serve.rules.request import MediaRef

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs the ffmpeg CLI to build test media")

H264 = ["-c:v", "libx264", "-preset", "ultrafast"]
H265 = ["-c:v", "libx265", "-preset", "ultrafast", "-x265-params", "log-level=error"]


def _ffmpeg(*args: str | Path) -> None:
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", *map(str, args)], check=True)


def _video(
    out: Path, seconds: float, size: str = "256x256", fps: int = 8, sound: list[str] | None = None, codec=H264
) -> None:
    """Test pattern video; `sound` is the audio codec arguments, or None for a silent file."""
    inputs = ["-f", "lavfi", "-i", f"testsrc=size={size}:rate={fps}:duration={seconds}"]
    if sound is not None:
        inputs += ["-f", "lavfi", "-i", f"sine=frequency=440:sample_rate=44100:duration={seconds}", "-ac", "2"]
    _ffmpeg(*inputs, *codec, "-pix_fmt", "yuv420p", *(sound or []), out)


def _audio(out: Path, seconds: float, rate: int = 16000, channels: int = 1, codec: list[str] | None = None) -> None:
    sine = f"sine=frequency=440:sample_rate={rate}:duration={seconds}"
    _ffmpeg("-f", "lavfi", "-i", sine, "-ac", str(channels), *(codec or []), out)


def _padded(src: Path, out: Path, size: int) -> None:
    """`src` followed by zero bytes up to exactly `size` bytes (sparse: costs no disk)."""
    shutil.copyfile(src, out)
    with open(out, "r+b") as f:
        f.truncate(size)


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)

    def image(name: str, w: int, h: int, fmt: str | None = None, **save) -> None:
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / name, fmt, **save)

    image("ok.png", 256, 256)
    image("ok.webp", 300, 256)
    image("wide_5x2.png", 640, 256)
    image("tall_2x5.jpg", 256, 640)
    image("wide_past.png", 641, 256)
    image("tall_past.png", 256, 641)
    image("small.png", 255, 256)
    image("gif.gif", 256, 256)
    Image.new("RGB", (5760, 2304), (20, 40, 60)).save(d / "max_edge.jpg")
    Image.new("RGB", (5761, 2305), (20, 40, 60)).save(d / "past_edge.jpg")
    # EXIF orientation 6: the stored 320x256 picture is shown rotated 90 degrees clockwise, i.e. 256x320.
    stored = np.zeros((256, 320, 3), np.uint8)
    stored[:64, :64] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(stored).save(d / "exif6.jpg", exif=exif, quality=95)
    rgba = np.full((256, 256, 4), 255, np.uint8)
    rgba[..., 3] = 128
    Image.fromarray(rgba, "RGBA").save(d / "alpha.webp", lossless=True)
    try:
        import pillow_heif

        pillow_heif.register_heif_opener()
        image("ok.heic", 256, 320, "HEIF")
    except ImportError:
        pass

    png = (d / "ok.png").read_bytes()
    (d / "truncated.png").write_bytes(png[: len(png) // 2])
    (d / "bad_magic.png").write_bytes(b"\x00" + png[1:])
    (d / "text.png").write_bytes(b"hello, this is not an image\n" * 20)
    (d / "empty.jpg").write_bytes(b"")
    (d / "png_named.mp4").write_bytes(png)
    _padded(d / "ok.png", d / "image_at_limit.png", limits.MAX_IMAGE_BYTES)
    _padded(d / "ok.png", d / "image_past_limit.png", limits.MAX_IMAGE_BYTES + 1)

    _video(d / "h264_aac.mp4", 2, fps=24, sound=["-c:a", "aac"])
    try:
        _video(d / "h265_aac.mp4", 2, fps=12, sound=["-c:a", "aac"], codec=H265)
    except subprocess.CalledProcessError:
        pass  # no libx265 in this ffmpeg: the H.265 case is skipped
    _video(d / "h264_mp3.mp4", 2, sound=["-c:a", "libmp3lame"])
    _video(d / "h264_silent.mp4", 2)
    _video(d / "h264.mkv", 2)
    _video(d / "clip_1.5s.mp4", 1.5)
    _video(d / "clip_15s.mp4", 15)
    _video(d / "clip_15.5s.mp4", 15.5)
    _video(d / "clip_7s.mp4", 7)
    _video(d / "clip_8s.mp4", 8)
    _video(d / "wide_5x2.mp4", 2, size="640x256")
    _video(d / "wide_past.mp4", 2, size="644x256")
    _video(d / "tall_past.mp4", 2, size="256x644")
    vp9 = ["-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8"]
    _ffmpeg("-f", "lavfi", "-i", "testsrc=size=256x256:rate=8:duration=2", *vp9, d / "vp9.webm")
    _video(d / "h264_flac.mkv", 2, sound=["-c:a", "flac"])
    _video(d / "rotate_base.mp4", 2, size="320x256")
    _ffmpeg("-i", d / "rotate_base.mp4", "-c", "copy", "-metadata:s:v:0", "rotate=90", d / "rotated.mp4")
    mp4 = (d / "h264_silent.mp4").read_bytes()
    (d / "truncated.mp4").write_bytes(mp4[: len(mp4) * 2 // 3])  # the moov box is at the end: cut off
    _padded(d / "h264_silent.mp4", d / "video_at_limit.mp4", limits.MAX_VIDEO_BYTES)
    _padded(d / "h264_silent.mp4", d / "video_past_limit.mp4", limits.MAX_VIDEO_BYTES + 1)

    _audio(d / "ok.wav", 2, rate=48000)
    _audio(d / "ok.mp3", 2, rate=44100, channels=2)
    _audio(d / "quad.wav", 2, channels=4)
    _audio(d / "audio_1.5s.wav", 1.5)
    _audio(d / "audio_15s.mp3", 15, codec=["-b:a", "32k"])
    _audio(d / "audio_15.5s.wav", 15.5)
    _audio(d / "audio_7s.wav", 7)
    _audio(d / "audio_8s.wav", 8)
    _audio(d / "ok.flac", 2)
    _audio(d / "ok.ogg", 2, codec=["-c:a", "libvorbis"])
    _audio(d / "mp3_in.wav", 2, codec=["-c:a", "libmp3lame"])
    wav = (d / "ok.wav").read_bytes()
    (d / "truncated.wav").write_bytes(wav[:40])
    (d / "id3_junk.mp3").write_bytes(
        b"ID3\x04\x00\x00\x00\x00\x00\x00" + rng.integers(0, 256, 4000, np.uint8).tobytes()
    )
    _padded(d / "ok.wav", d / "audio_at_limit.wav", limits.MAX_AUDIO_BYTES)
    _padded(d / "ok.wav", d / "audio_past_limit.wav", limits.MAX_AUDIO_BYTES + 1)
    return d


def _ref(media: Path, name: str, kind: str | None = None) -> MediaRef:
    return MediaRef(path=media / name, name=name, kind=kind)


# --------------------------------------------------------------------------------------------------------------------
# Malformed inputs: one row each -> (loader, files, error type, field, phrase of the limit in the message)

IMG, VID, AUD, ANY, REFS = "image", "video", "audio", "media", "references"
EDGES = "both image edges 256-5760 px"
ASPECT = "between 5:2 and 2:5"
CLIP = "each clip 2-15 s"

BAD = [
    ("image-edge-255", IMG, "small.png", MediaLimitError, "image", EDGES),
    ("image-edge-5761", IMG, "past_edge.jpg", MediaLimitError, "image", EDGES),
    ("image-aspect-641x256", IMG, "wide_past.png", MediaLimitError, "image", ASPECT),
    ("image-aspect-256x641", IMG, "tall_past.png", MediaLimitError, "image", ASPECT),
    ("image-bytes-30MiB+1", IMG, "image_past_limit.png", MediaLimitError, "image", "image files at most 30 MiB"),
    ("image-truncated", IMG, "truncated.png", MediaDecodeError, "image", "a complete, valid file"),
    ("image-bad-magic", IMG, "bad_magic.png", MediaFormatError, "image", "JPEG, PNG, WEBP or HEIC/HEIF"),
    ("image-text-file", IMG, "text.png", MediaFormatError, "image", "JPEG, PNG, WEBP or HEIC/HEIF"),
    ("image-empty", IMG, "empty.jpg", MediaFormatError, "image", "JPEG, PNG, WEBP or HEIC/HEIF"),
    ("image-gif", IMG, "gif.gif", MediaFormatError, "image", "JPEG, PNG, WEBP or HEIC/HEIF"),
    ("image-is-audio", IMG, "ok.wav", MediaFormatError, "image", "JPEG, PNG, WEBP or HEIC/HEIF"),
    ("image-missing", IMG, "no_such_file.png", MediaDecodeError, "image", "a readable file"),
    ("video-1.5s", VID, "clip_1.5s.mp4", MediaLimitError, "video", CLIP),
    ("video-15.5s", VID, "clip_15.5s.mp4", MediaLimitError, "video", CLIP),
    ("video-aspect-644x256", VID, "wide_past.mp4", MediaLimitError, "video", ASPECT),
    ("video-aspect-256x644", VID, "tall_past.mp4", MediaLimitError, "video", ASPECT),
    ("video-bytes-50MiB+1", VID, "video_past_limit.mp4", MediaLimitError, "video", "video files at most 50 MiB"),
    ("video-vp9", VID, "vp9.webm", MediaFormatError, "video", "H.264 or H.265"),
    ("video-flac-sound", VID, "h264_flac.mkv", MediaFormatError, "video", "with AAC, MP3 or no sound"),
    ("video-truncated", VID, "truncated.mp4", MediaDecodeError, "video", "a complete, valid file"),
    ("video-is-image", VID, "ok.png", MediaFormatError, "video", "H.264 or H.265"),
    ("audio-1.5s", AUD, "audio_1.5s.wav", MediaLimitError, "audio", CLIP),
    ("audio-15.5s", AUD, "audio_15.5s.wav", MediaLimitError, "audio", CLIP),
    ("audio-bytes-15MiB+1", AUD, "audio_past_limit.wav", MediaLimitError, "audio", "audio files at most 15 MiB"),
    ("audio-flac", AUD, "ok.flac", MediaFormatError, "audio", "WAV (PCM) or MP3"),
    ("audio-ogg", AUD, "ok.ogg", MediaFormatError, "audio", "WAV (PCM) or MP3"),
    ("audio-mp3-in-wav", AUD, "mp3_in.wav", MediaFormatError, "audio", "WAV (PCM) or MP3"),
    ("audio-truncated-wav", AUD, "truncated.wav", MediaDecodeError, "audio", "a complete, valid file"),
    ("audio-id3-junk", AUD, "id3_junk.mp3", MediaDecodeError, "audio", "a complete, valid file"),
    ("declared-video-is-image", ANY, ("ok.png", "video"), MediaFormatError, "ref", "H.264 or H.265"),
    ("declared-image-is-audio", ANY, ("ok.mp3", "image"), MediaFormatError, "ref", "JPEG, PNG, WEBP"),
    ("refs-audio-only", REFS, ["ok.wav", "ok.mp3"], ReferenceSetError, "references[0]", "need at least one image"),
    (
        "refs-13-files",
        REFS,
        ["ok.png"] * 9 + ["ok.wav"] * 3 + ["h264_silent.mp4"],
        ReferenceSetError,
        "references[12]",
        "at most 12 files",
    ),
    ("refs-10-images", REFS, ["ok.png"] * 10, ReferenceSetError, "references[9]", "at most 9 image references"),
    ("refs-4-videos", REFS, ["h264_silent.mp4"] * 4, ReferenceSetError, "references[3]", "at most 3 video references"),
    (
        "refs-4-audio",
        REFS,
        ["ok.png"] + ["ok.wav"] * 4,
        ReferenceSetError,
        "references[4]",
        "at most 3 audio references",
    ),
    (
        "refs-16s-video",
        REFS,
        ["clip_8s.mp4", "ok.png", "clip_8s.mp4"],
        ReferenceSetError,
        "references[2]",
        "at most 15 s of video references in total",
    ),
    (
        "refs-16s-audio",
        REFS,
        ["audio_8s.wav", "ok.png", "audio_8s.wav"],
        ReferenceSetError,
        "references[2]",
        "at most 15 s of audio references in total",
    ),
    ("refs-1.5s-audio", REFS, ["ok.png", "audio_1.5s.wav"], MediaLimitError, "references[1]", CLIP),
    ("refs-corrupt-video", REFS, ["ok.png", "truncated.mp4"], MediaDecodeError, "references[1]", "valid file"),
    ("refs-declared-wrong", REFS, [("ok.png", "audio"), "ok.wav"], MediaFormatError, "references[0]", "WAV (PCM)"),
]


def _run(media: Path, loader: str, files, field: str):
    if loader == REFS:
        refs = [_ref(media, *f) if isinstance(f, tuple) else _ref(media, f) for f in files]
        return intake.load_references(refs)
    ref = _ref(media, *files) if isinstance(files, tuple) else _ref(media, files)
    fn = {IMG: intake.load_image, VID: intake.load_video, AUD: intake.load_audio, ANY: intake.load_media}[loader]
    return fn(ref, field)


@pytest.mark.parametrize(("loader", "files", "error", "field", "phrase"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_malformed_input_is_refused_with_a_clear_error(media, loader, files, error, field, phrase):
    with pytest.raises(error) as info:
        _run(media, loader, files, field)
    err = info.value
    text = str(err)
    assert err.field == field
    assert phrase in err.limit and phrase in text
    assert "\n" not in text and text.startswith(f"{field} (") and f"'{err.file}'" in text
    assert str(media) not in text  # never the server-side path


# --------------------------------------------------------------------------------------------------------------------
# Valid inputs


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("ok.png", (256, 256)),  # both edges at the minimum
        ("ok.webp", (300, 256)),
        ("wide_5x2.png", (640, 256)),  # aspect exactly 5:2
        ("tall_2x5.jpg", (256, 640)),  # ... and 2:5
        ("max_edge.jpg", (5760, 2304)),  # the maximum edge
        ("image_at_limit.png", (256, 256)),  # exactly 30 MiB
        ("alpha.webp", (256, 256)),
        ("png_named.mp4", (256, 256)),  # the bytes decide, not the name
    ],
)
def test_valid_images_load_as_rgb(media, name, size):
    out = intake.load_media(_ref(media, name), "image")
    assert isinstance(out, ImageMedia) and out.name == name
    assert out.image.mode == "RGB" and out.image.size == size


def test_heic_loads_through_the_plugin(media):
    if not (media / "ok.heic").exists():
        pytest.skip("pillow-heif is not installed")
    out = intake.load_image(_ref(media, "ok.heic", "image"), "image")
    assert out.image.mode == "RGB" and out.image.size == (256, 320)


def test_exif_orientation_is_applied(media):
    img = np.asarray(intake.load_image(_ref(media, "exif6.jpg"), "image").image)
    assert img.shape == (320, 256, 3)  # shown rotated 90 degrees clockwise
    assert img[:64, -64:, 0].mean() > 200 and img[:64, :64, 0].mean() < 50  # the red corner moved top-left -> right


@pytest.mark.parametrize(
    ("name", "frames", "fps", "audio"),
    [
        ("h264_aac.mp4", 48, 24.0, (2, 44100)),
        ("h265_aac.mp4", 24, 12.0, (2, 44100)),
        ("h264_mp3.mp4", 16, 8.0, (2, 44100)),
        ("h264_silent.mp4", 16, 8.0, None),
        ("h264.mkv", 16, 8.0, None),
        ("clip_15s.mp4", 120, 8.0, None),  # the longest clip
        ("wide_5x2.mp4", 16, 8.0, None),
        ("video_at_limit.mp4", 16, 8.0, None),  # exactly 50 MiB
    ],
)
def test_valid_videos_load_with_frames_fps_and_soundtrack(media, name, frames, fps, audio):
    if not (media / name).exists():
        pytest.skip(f"{name}: this ffmpeg cannot encode it")
    out = intake.load_media(_ref(media, name), "video")
    assert isinstance(out, VideoMedia)
    h, w = (256, 640) if "wide" in name else (256, 256)
    assert out.frames.shape == (frames, h, w, 3) and out.frames.dtype == np.uint8
    assert out.fps == fps and out.duration_s == pytest.approx(frames / fps)
    if audio is None:
        assert out.audio is None
    else:
        channels, rate = audio
        assert out.audio.sample_rate == rate and out.audio.samples.shape[0] == channels
        assert out.audio.samples.dtype == np.float32 and np.abs(out.audio.samples).max() <= 1.0
        assert out.audio.duration_s == pytest.approx(2.0, abs=limits.MEDIA_DURATION_SLACK_S)


def test_video_rotation_matches_the_ffmpeg_cli(media):
    out = intake.load_video(_ref(media, "rotated.mp4"), "video")
    assert out.frames.shape == (16, 320, 256, 3)
    first_frame = ["-frames:v", "1", "-f", "rawvideo", "-pix_fmt", "rgb24", "-"]
    cmd = ["ffmpeg", "-loglevel", "error", "-i", str(media / "rotated.mp4"), *first_frame]
    raw = subprocess.run(cmd, capture_output=True, check=True).stdout
    upright = np.frombuffer(raw, np.uint8).reshape(320, 256, 3)
    assert np.abs(upright.astype(int) - out.frames[0]).mean() < 1.0


@pytest.mark.parametrize(
    ("name", "shape", "rate"),
    [
        ("ok.wav", (1, 96000), 48000),
        ("ok.mp3", (2, 88200), 44100),
        ("quad.wav", (2, 32000), 16000),  # more than two channels: downmixed to stereo
        ("audio_15s.mp3", (1, 240000), 16000),  # the longest clip
        ("audio_at_limit.wav", (1, 96000), 48000),  # exactly 15 MiB
    ],
)
def test_valid_audio_loads_as_float32_planar(media, name, shape, rate):
    out = intake.load_media(_ref(media, name, "audio"), "audio")
    assert isinstance(out, AudioMedia)
    assert out.samples.shape == shape and out.samples.dtype == np.float32 and out.sample_rate == rate
    assert 0.05 < np.abs(out.samples).max() <= 1.0  # lavfi sine: amplitude 1/8


def test_reference_set_at_its_limits_loads_in_order(media):
    # 7 + 2 = 9 s of video; 7 + 8 = 15 s of audio (a soundtrack counts towards neither); 12 files.
    files = ["clip_7s.mp4", "ok.png", "audio_7s.wav", "h264_aac.mp4", "audio_8s.wav"]
    out = intake.load_references([_ref(media, f) for f in files] + [_ref(media, "ok.png")] * 7)
    assert [type(m).__name__ for m in out[:5]] == ["VideoMedia", "ImageMedia", "AudioMedia", "VideoMedia", "AudioMedia"]
    assert len(out) == 12 and out[3].audio is not None
    videos = intake.load_references([_ref(media, "clip_8s.mp4"), _ref(media, "clip_7s.mp4")])  # exactly 15 s
    assert sum(v.duration_s for v in videos) == 15.0


def test_sniff_reads_the_bytes(media):
    assert intake.sniff(media / "png_named.mp4") == "image"
    assert intake.sniff(media / "h264_aac.mp4") == "video"
    assert intake.sniff(media / "ok.mp3") == "audio"
    assert intake.sniff(media / "text.png") is None
    assert intake.sniff(media / "no_such_file") is None


def test_resample_audio_keeps_the_signal_and_has_torchaudio_length():
    rate, target = 44100, 32000
    t = np.arange(rate + 1) / rate
    x = np.stack([np.sin(2 * np.pi * 440 * t), np.cos(2 * np.pi * 440 * t)]).astype(np.float32)
    y = intake.resample_audio(x, rate, target)
    assert y.shape == (2, 32001) and y.dtype == np.float32  # ceil(44101 * 32000 / 44100)
    t2 = np.arange(y.shape[1]) / target
    assert np.abs(y[0, 64:-64] - np.sin(2 * np.pi * 440 * t2[64:-64])).max() < 1e-3
    assert np.array_equal(intake.resample_audio(x[:1], target, target), x[:1])


def test_start_time_seconds_trims_reference_videos_and_their_soundtrack(tmp_path):
    from h3serve.media.media_inputs import load_references
    from h3serve.media.mp4 import write_mp4

    path = tmp_path / "six.mp4"  # 6 s, frame i at grey level i
    frames = np.arange(144, dtype=np.float32)[:, None, None, None] / 255 * np.ones((144, 64, 64, 3))
    write_mp4(path, frames.astype(np.float32), np.zeros((2, 6 * 32_000), dtype=np.float32))
    ref = MediaRef(path, "six.mp4", "video")
    (video,) = load_references([ref], start_times=[3.0])
    assert video.frames.shape[0] == 72 and abs(int(video.frames[0, 32, 32, 0]) - 72) <= 3
    assert abs(video.audio.samples.shape[1] / video.audio.sample_rate - 3.0) < 0.1
    assert load_references([ref], start_times=[0.0])[0].frames.shape[0] == 144
    with pytest.raises(MediaLimitError, match="2-15 s|at least"):
        load_references([ref], start_times=[5.0])  # 1 s left
    with pytest.raises(MediaLimitError, match="outside the source duration"):
        load_references([ref], start_times=[7.0])
    with pytest.raises(ReferenceSetError, match="2 start times for 1 video"):
        load_references([ref], start_times=[1.0, 2.0])
