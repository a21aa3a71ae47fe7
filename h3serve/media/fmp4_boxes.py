"""Fragmented-MP4 boxes (ISO/IEC 14496-12 and -14, ISO/IEC 14496-15 for avcC): the init segment (ftyp + moov)
of one H.264 and one AAC track, and one fragment (moof + mdat) of already encoded samples.

Written here rather than by FFmpeg's mov muxer because a real-time session must cut a fragment exactly at each
chunk's end, when the chunk is ready; PyAV offers no way to ask the muxer for that flush (`av_write_frame(s, NULL)`),
and the muxer on its own only closes a fragment when the next one's first packet arrives.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

VIDEO_TRACK_ID = 1
AUDIO_TRACK_ID = 2
_UNITY_MATRIX = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
_LANGUAGE_UND = 0x55C4  # "und", packed as three 5-bit letters
_KEY_SAMPLE = 0x02000000  # sample_depends_on = 2 (an I/IDR picture, or an audio frame)
_DELTA_SAMPLE = 0x01010000  # sample_depends_on = 1, sample_is_non_sync_sample
_HIGH_PROFILES = (100, 110, 122, 144)  # avcC carries its chroma and bit-depth extension for these


def box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return box(kind, struct.pack(">I", (version << 24) | flags), *payload)


@dataclass(frozen=True)
class VideoTrack:
    width: int
    height: int
    timescale: int
    sps: bytes  # one SPS NAL unit, without start code
    pps: bytes  # one PPS NAL unit, without start code


@dataclass(frozen=True)
class AudioTrack:
    sample_rate: int
    channels: int
    config: bytes  # the AAC AudioSpecificConfig (the encoder's extradata)
    priming: int  # samples the encoder put before the first input sample (cut by the edit list)
    bit_rate: int


@dataclass(frozen=True)
class Sample:
    size: int
    duration: int
    key: bool = True


@dataclass(frozen=True)
class TrackRun:
    """One track's samples in one fragment: their timing, sizes and bytes (in decode order)."""

    track_id: int
    base_time: int  # decode time of the first sample, in the track's timescale
    samples: tuple[Sample, ...]
    data: bytes


def avc_codec_string(sps: bytes) -> str:
    """The RFC 6381 codec name of an H.264 stream with this SPS ("avc1.PPCCLL"), for MediaSource."""
    return f"avc1.{sps[1]:02X}{sps[2]:02X}{sps[3]:02X}"


def init_segment(video: VideoTrack, audio: AudioTrack) -> bytes:
    """ftyp + moov: both tracks described, no samples (they all come in fragments: mvex)."""
    ftyp = box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isom", b"iso6", b"avc1", b"mp41")
    mvhd = full_box(b"mvhd", 0, 0, struct.pack(">IIIIIH", 0, 0, 1000, 0, 0x10000, 0x0100), bytes(10),
                    _UNITY_MATRIX, bytes(24), struct.pack(">I", AUDIO_TRACK_ID + 1))
    trex = [full_box(b"trex", 0, 0, struct.pack(">5I", track, 1, 0, 0, 0)) for track in (VIDEO_TRACK_ID,
                                                                                           AUDIO_TRACK_ID)]
    return ftyp + box(b"moov", mvhd, _video_trak(video), _audio_trak(audio), box(b"mvex", *trex))


def fragment(sequence: int, runs: list[TrackRun]) -> bytes:
    """moof + mdat of the runs that hold samples (the mdat holds their bytes in the order given)."""
    runs = [run for run in runs if run.samples]
    if not runs:
        return b""
    # The trun's data offsets count from the moof's first byte, so its size comes first (it does not depend on them).
    moof_size = len(_moof(sequence, runs, [0] * len(runs)))
    offsets, at = [], moof_size + 8
    for run in runs:
        offsets.append(at)
        at += len(run.data)
    return _moof(sequence, runs, offsets) + box(b"mdat", *(run.data for run in runs))


def _moof(sequence: int, runs: list[TrackRun], offsets: list[int]) -> bytes:
    trafs = []
    for run, offset in zip(runs, offsets, strict=True):
        tfhd = full_box(b"tfhd", 0, 0x020000, struct.pack(">I", run.track_id))  # default-base-is-moof
        tfdt = full_box(b"tfdt", 1, 0, struct.pack(">Q", run.base_time))
        entries = b"".join(struct.pack(">III", s.duration, s.size, _KEY_SAMPLE if s.key else _DELTA_SAMPLE)
                           for s in run.samples)
        # flags: data-offset, sample-duration, sample-size and sample-flags present
        trun = full_box(b"trun", 0, 0x000701, struct.pack(">Ii", len(run.samples), offset), entries)
        trafs.append(box(b"traf", tfhd, tfdt, trun))
    return box(b"moof", full_box(b"mfhd", 0, 0, struct.pack(">I", sequence)), *trafs)


def _trak(track_id: int, timescale: int, handler: bytes, name: bytes, header: bytes, entry: bytes,
          tkhd_tail: bytes, edit: bytes = b"") -> bytes:
    tkhd = full_box(b"tkhd", 0, 0x3, struct.pack(">IIIII", 0, 0, track_id, 0, 0), bytes(8), tkhd_tail)
    mdhd = full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, timescale, 0, _LANGUAGE_UND, 0))
    hdlr = full_box(b"hdlr", 0, 0, bytes(4), handler, bytes(12), name + b"\0")
    dinf = box(b"dinf", full_box(b"dref", 0, 0, struct.pack(">I", 1), full_box(b"url ", 0, 1)))
    stbl = box(b"stbl", full_box(b"stsd", 0, 0, struct.pack(">I", 1), entry),
               full_box(b"stts", 0, 0, bytes(4)), full_box(b"stsc", 0, 0, bytes(4)),
               full_box(b"stsz", 0, 0, bytes(8)), full_box(b"stco", 0, 0, bytes(4)))
    return box(b"trak", tkhd, edit, box(b"mdia", mdhd, hdlr, box(b"minf", header, dinf, stbl)))


def _video_trak(video: VideoTrack) -> bytes:
    profile = video.sps[1]
    avcc = struct.pack(">BBBBBB", 1, profile, video.sps[2], video.sps[3], 0xFF, 0xE1)  # 4-byte NAL lengths, 1 SPS
    avcc += struct.pack(">H", len(video.sps)) + video.sps + struct.pack(">BH", 1, len(video.pps)) + video.pps
    if profile in _HIGH_PROFILES:
        avcc += bytes((0xFC | 1, 0xF8, 0xF8, 0))  # 4:2:0, 8-bit luma and chroma, no SPS extensions
    colr = box(b"colr", b"nclx", struct.pack(">HHHB", 1, 1, 1, 0))  # BT.709 primaries, transfer, matrix; limited
    entry = box(b"avc1", bytes(6), struct.pack(">H", 1), bytes(16),
                struct.pack(">HHIIIH", video.width, video.height, 0x480000, 0x480000, 0, 1), bytes(32),
                struct.pack(">Hh", 0x18, -1), box(b"avcC", avcc), colr)
    tail = struct.pack(">HHHH", 0, 0, 0, 0) + _UNITY_MATRIX + struct.pack(">II", video.width << 16,
                                                                           video.height << 16)
    vmhd = full_box(b"vmhd", 0, 1, bytes(8))
    return _trak(VIDEO_TRACK_ID, video.timescale, b"vide", b"VideoHandler", vmhd, entry, tail)


def _audio_trak(audio: AudioTrack) -> bytes:
    entry = box(b"mp4a", bytes(6), struct.pack(">H", 1), bytes(8),
                struct.pack(">HHHHI", audio.channels, 16, 0, 0, audio.sample_rate << 16), _esds(audio))
    tail = struct.pack(">HHHH", 0, 0, 0x0100, 0) + _UNITY_MATRIX + bytes(8)
    smhd = full_box(b"smhd", 0, 0, bytes(4))
    # The edit list starts the presentation after the encoder's priming samples, so audio sample 0 plays with
    # video frame 0. Its duration 0 is "until the end" in a fragmented file, whose length the moov cannot know.
    elst = full_box(b"elst", 0, 0, struct.pack(">IIihh", 1, 0, audio.priming, 1, 0))
    return _trak(AUDIO_TRACK_ID, audio.sample_rate, b"soun", b"SoundHandler", smhd, entry, tail,
                 box(b"edts", elst))


def _descriptor(tag: int, payload: bytes) -> bytes:
    size = len(payload)  # the 4-byte form of the expandable size (7 bits a byte), as FFmpeg writes it
    return bytes((tag, 0x80 | (size >> 21) & 0x7F, 0x80 | (size >> 14) & 0x7F, 0x80 | (size >> 7) & 0x7F,
                  size & 0x7F)) + payload


def _esds(audio: AudioTrack) -> bytes:
    # objectTypeIndication 0x40 (MPEG-4 audio), streamType 5 (audio) << 2 | upStream 0 | reserved 1
    decoder_config = struct.pack(">BB", 0x40, 0x15) + (6144 * audio.channels).to_bytes(3, "big")
    decoder_config += struct.pack(">II", audio.bit_rate, audio.bit_rate) + _descriptor(0x05, audio.config)
    es = struct.pack(">HB", AUDIO_TRACK_ID, 0) + _descriptor(0x04, decoder_config) + _descriptor(0x06, b"\x02")
    return full_box(b"esds", 0, 0, _descriptor(0x03, es))
