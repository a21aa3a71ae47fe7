"""Fragmented MP4 for a real-time session: one segment per generated chunk, for a browser's Media Source Extensions.

The encoders run for the whole session (H.264 with x264's zero-latency tuning: no frame is held back, so a chunk's
pictures all leave with it; AAC-LC stereo, which holds back its 1,024 priming samples and any partial frame until
more audio or the end comes). Each chunk starts on an IDR picture, so every segment can be decoded from its own
first picture on. Concatenating every segment gives one playable MP4 with exactly the frames fed; its audio is the
samples fed, the priming cut by the init segment's edit list, followed by the zeros that fill the last AAC frame
(under 1,024 samples), as `h3serve.media.mp4` leaves them.
"""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
from av.codec.context import Flags
from av.video.frame import PictureType
from av.video.reformatter import ColorPrimaries, ColorRange, Colorspace, ColorTrc

from h3serve.media.aac_packets import AAC_FRAME_SAMPLES, aac_input
from h3serve.media.fmp4_boxes import (
    AUDIO_TRACK_ID,
    VIDEO_TRACK_ID,
    AudioTrack,
    Sample,
    TrackRun,
    VideoTrack,
    avc_codec_string,
    fragment,
    init_segment,
)
from h3serve.media.mp4 import EncoderOptions, yuv_frame
from h3serve.rules import limits

STREAM_OPTIONS = EncoderOptions(preset="ultrafast")  # as vLLM-Omni streams: ultrafast, tuned for zero latency
_VIDEO_TICKS = 512  # video timescale = fps * 512 (12,288 at 24 fps, as FFmpeg picks)


class FragmentWriter:
    """Fragmented MP4 (H.264 + stereo AAC 32 kHz, 24 fps) one segment per chunk, for MSE."""

    def __init__(self, width: int, height: int, *, fps: int = limits.FPS,
                 sample_rate: int = limits.AUDIO_SAMPLE_RATE, options: EncoderOptions | None = None) -> None:
        for name, value in (("width", width), ("height", height), ("fps", fps), ("sample_rate", sample_rate)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if width % 2 or height % 2:
            raise ValueError(f"yuv420p needs even width and height, got {width}x{height} (W x H)")
        self.options = (options or STREAM_OPTIONS).validate(sample_rate)
        self.width, self.height, self.fps, self.sample_rate = width, height, fps, sample_rate
        self._video = _video_encoder(width, height, fps, self.options)
        self._audio = _audio_encoder(sample_rate, self.options)
        sps, pps = _parameter_sets(bytes(self._video.extradata))
        self._video_track = VideoTrack(width, height, fps * _VIDEO_TICKS, sps, pps)
        self._audio_track = AudioTrack(sample_rate, 2, bytes(self._audio.extradata), AAC_FRAME_SAMPLES,
                                       self.options.audio_bitrate)
        self.codecs = f"{avc_codec_string(sps)}, mp4a.40.2"  # for MediaSource.isTypeSupported / addSourceBuffer
        self._pending = np.zeros((2, 0), dtype=np.float32)  # audio not yet a whole AAC frame
        self._frames = 0  # video frames encoded
        self._audio_in = 0  # audio samples given to the encoder
        self._video_out = 0  # pictures written to segments
        self._audio_out = 0  # AAC frames written to segments (x 1,024 samples of media time)
        self._sequence = 0  # fragments written
        self._closed = False

    @property
    def mime_type(self) -> str:
        return f'video/mp4; codecs="{self.codecs}"'

    def segment(self, frames: np.ndarray, audio: np.ndarray) -> bytes:
        """frames uint8 [F, H, W, 3], audio float32 [S, 2] in [-1, 1] -> one fragment (moof+mdat...);
        the first call's bytes start with the init segment (ftyp+moov). Every segment starts on a key frame."""
        if self._closed:
            raise ValueError("the writer is finished")
        self._check(frames, audio)
        video = [packet for i, rgb in enumerate(frames) for packet in self._encode_frame(rgb, key=i == 0)]
        self._pending = np.concatenate([self._pending, np.clip(audio.T, -1.0, 1.0)], axis=1)
        whole = self._pending.shape[1] // AAC_FRAME_SAMPLES * AAC_FRAME_SAMPLES
        sound = self._encode_audio(self._pending[:, :whole])
        self._pending = self._pending[:, whole:]
        return self._emit(video, sound)

    def finish(self) -> bytes:
        """Flush what the encoders still hold (the trailer segment; b"" if nothing) and close."""
        if self._closed:
            return b""
        self._closed = True
        video = list(self._video.encode(None))
        sound = self._encode_audio(self._pending) + list(self._audio.encode(None))
        self._pending = self._pending[:, :0]
        return self._emit(video, sound) if self._sequence else b""

    def _check(self, frames: np.ndarray, audio: np.ndarray) -> None:
        shape = (self.height, self.width, 3)
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or \
                frames.shape[1:] != shape or frames.shape[0] < 1:
            got = f"{frames.dtype} {list(frames.shape)}" if isinstance(frames, np.ndarray) else type(frames).__name__
            raise ValueError(f"frames must be uint8 [F >= 1, {self.height}, {self.width}, 3], got {got}")
        if not isinstance(audio, np.ndarray) or audio.dtype != np.float32 or audio.ndim != 2 or audio.shape[1] != 2:
            got = f"{audio.dtype} {list(audio.shape)}" if isinstance(audio, np.ndarray) else type(audio).__name__
            raise ValueError(f"audio must be float32 [S, 2], got {got}")
        if not np.isfinite(audio).all():
            raise ValueError("audio contains NaN or inf")

    def _encode_frame(self, rgb: np.ndarray, key: bool) -> list[av.Packet]:
        frame = yuv_frame(rgb, self._frames)
        frame.pict_type = PictureType.I if key else PictureType.NONE  # forced-idr: an I here is an IDR
        self._frames += 1
        return list(self._video.encode(frame))

    def _encode_audio(self, pcm: np.ndarray) -> list[av.Packet]:
        packets = []
        for start in range(0, pcm.shape[1], AAC_FRAME_SAMPLES):
            frame = aac_input(pcm, start, self.sample_rate, pts=self._audio_in)
            self._audio_in += frame.samples
            packets += self._audio.encode(frame)
        return packets

    def _emit(self, video: list[av.Packet], sound: list[av.Packet]) -> bytes:
        head = b"" if self._sequence else init_segment(self._video_track, self._audio_track)
        pictures = [_length_prefixed(p) for p in video]
        video_run = TrackRun(VIDEO_TRACK_ID, self._video_out * _VIDEO_TICKS,
                             tuple(Sample(len(d), _VIDEO_TICKS, p.is_keyframe) for p, d in zip(video, pictures,
                                                                                               strict=True)),
                             b"".join(pictures))
        audio_run = TrackRun(AUDIO_TRACK_ID, self._audio_out * AAC_FRAME_SAMPLES,
                             tuple(Sample(p.size, AAC_FRAME_SAMPLES) for p in sound), b"".join(bytes(p) for p in sound))
        self._video_out += len(video)
        self._audio_out += len(sound)
        body = fragment(self._sequence + 1, [video_run, audio_run])
        if body:
            self._sequence += 1
        return head + body


def _video_encoder(width: int, height: int, fps: int, options: EncoderOptions) -> av.VideoCodecContext:
    cc = av.CodecContext.create("libx264", "w")
    cc.width, cc.height, cc.pix_fmt = width, height, "yuv420p"
    cc.time_base, cc.framerate = Fraction(1, fps), Fraction(fps, 1)
    cc.flags |= Flags.global_header  # SPS/PPS in extradata (the avcC), not repeated in the pictures
    cc.thread_count = options.threads
    cc.colorspace, cc.color_range = Colorspace.ITU709, ColorRange.MPEG
    cc.color_primaries, cc.color_trc = ColorPrimaries.BT709, ColorTrc.BT709
    # zerolatency: no B-frames, no lookahead, sliced threads: a picture's packet leaves with it. A GOP never ends on
    # its own (keyint infinite): each chunk's first picture is the IDR, asked for by pict_type.
    cc.options = {"preset": options.preset, "tune": "zerolatency", "crf": str(options.crf), "forced-idr": "1",
                  "x264-params": "keyint=infinite:scenecut=0"}
    cc.open()
    return cc


def _audio_encoder(sample_rate: int, options: EncoderOptions) -> av.AudioCodecContext:
    cc = av.CodecContext.create("aac", "w")
    cc.sample_rate, cc.layout, cc.format = sample_rate, "stereo", "fltp"
    cc.time_base = Fraction(1, sample_rate)
    cc.bit_rate = options.audio_bitrate
    cc.flags |= Flags.global_header
    cc.open()
    return cc


def _nal_units(annex_b: bytes) -> list[bytes]:
    """The NAL units of an Annex B byte stream (3- or 4-byte start codes), without their start codes."""
    starts, at = [], annex_b.find(b"\0\0\1")
    while at >= 0:
        starts.append(at + 3)
        at = annex_b.find(b"\0\0\1", at + 3)
    ends = [s - 3 for s in starts[1:]] + [len(annex_b)]
    # a 4-byte start code's leading zero is not part of the unit before it (a NAL unit never ends on a zero byte)
    return [annex_b[s:e].rstrip(b"\0") for s, e in zip(starts, ends, strict=True)]


def _parameter_sets(extradata: bytes) -> tuple[bytes, bytes]:
    """(SPS, PPS) of x264's global header (Annex B)."""
    units = _nal_units(extradata)
    sps = [u for u in units if u[0] & 0x1F == 7]
    pps = [u for u in units if u[0] & 0x1F == 8]
    if len(sps) != 1 or len(pps) != 1:
        raise ValueError(f"expected one SPS and one PPS in the H.264 header, got {len(sps)} and {len(pps)}")
    return sps[0], pps[0]


def _length_prefixed(packet: av.Packet) -> bytes:
    """An Annex B access unit as MP4 stores it: each NAL unit after its 4-byte length (SEI kept)."""
    return b"".join(len(u).to_bytes(4, "big") + u for u in _nal_units(bytes(packet)))
