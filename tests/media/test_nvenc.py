"""The NVENC writer (h3serve.media.nvenc) without a GPU: its NV12 conversion, its encoder choice and, with a CPU
stand-in for the NVENC session (libx264 emitting Annex-B access units as NVENC does), its MP4 muxing."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from av.video.reformatter import ColorRange, Colorspace

from h3serve.media.mp4 import EncoderOptions, nvenc_refusal, rgb8, yuv_frame
from h3serve.media.nvenc import NvencMp4Writer, choose_encoder, rgb_to_nv12


def test_nv12_is_the_mp4_writers_bt709_conversion_to_within_rounding():
    """On a smooth picture (swscale's chroma filter is wider than the 2x2 average; on edges they part)."""
    y, x = np.mgrid[0:32, 0:48]
    rgb = np.stack([x * 5, y * 7, 255 - x * 3 - y * 2], axis=-1).clip(0, 255).astype(np.uint8)
    nv12 = rgb_to_nv12(torch.from_numpy(rgb)).numpy()
    planes = yuv_frame(rgb, 0).to_ndarray()  # swscale's yuv420p: [H·3/2, W], Y then U then V
    y, u, v = planes[:32], planes[32:40].reshape(16, 24), planes[40:].reshape(16, 24)
    assert np.abs(nv12[:32].astype(int) - y).max() <= 1
    chroma = nv12[32:].reshape(16, 24, 2).astype(int)
    assert np.abs(chroma[..., 0] - u).max() <= 2 and np.abs(chroma[..., 1] - v).max() <= 2


def test_the_encoder_choice_says_why_not_nvenc():
    cpu = torch.device("cpu")
    assert choose_encoder(EncoderOptions(encoder="x264"), cpu) == "x264"
    assert choose_encoder(EncoderOptions(encoder="auto"), cpu) == "x264"
    with pytest.raises(ValueError, match="--video-encoder nvenc: the frames are on cpu"):
        choose_encoder(EncoderOptions(encoder="nvenc"), cpu)
    with pytest.raises(ValueError, match="unknown video encoder 'vp9'"):
        EncoderOptions(encoder="vp9").validate()


class _AnnexB:
    """An NVENC session's interface (`Encode(frame)` -> access units, `EndEncode()`), encoding the NV12 planes it
    is given with libx264 on the CPU."""

    def __init__(self, width, height, options, device, frames, fps):
        self.codec = av.CodecContext.create("libx264", "w")
        self.codec.width, self.codec.height, self.codec.pix_fmt = width, height, "yuv420p"
        self.codec.time_base = Fraction(1, fps)
        self.codec.options = {"preset": "ultrafast", "bframes": "0", "qp": str(options.crf)}
        self.index = 0

    def Encode(self, frame):  # noqa: N802 (PyNvVideoCodec's name)
        luma, chroma = (plane.numpy() for plane in frame.cuda())
        planes = np.concatenate([luma[..., 0].ravel(), chroma[..., 0].ravel(), chroma[..., 1].ravel()])
        height, width = luma.shape[:2]
        picture = av.VideoFrame.from_ndarray(planes.reshape(height * 3 // 2, width), format="yuv420p")
        picture.pts = self.index
        self.index += 1
        return [{"data": bytes(p)} for p in self.codec.encode(picture)]

    def EndEncode(self):  # noqa: N802
        return [{"data": bytes(p)} for p in self.codec.encode(None)]


def test_nvenc_access_units_are_muxed_with_the_soundtrack(tmp_path):
    rng = np.random.default_rng(1)
    t, y, x = np.mgrid[0:22, 0:32, 0:48].astype(np.float32)
    video = np.stack([0.5 + 0.4 * np.sin((x + 2 * t) / 7), 0.5 + 0.3 * np.cos(y / 5 - t / 9), x / 60 + y / 90],
                     axis=-1).astype(np.float32)  # smooth: chroma at half resolution keeps it
    audio = rng.uniform(-0.3, 0.3, (2, 30_000)).astype(np.float32)
    frames = torch.from_numpy(rgb8(video))
    path = tmp_path / "nvenc.mp4"
    with NvencMp4Writer(path, 22, 32, 48, audio, options=EncoderOptions(crf=10), device=torch.device("cpu"),
                        encoder_factory=_AnnexB) as writer:
        writer.write(frames[:17])
        writer.write(frames[17:])
    with av.open(str(path)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
        assert container.streams.audio[0].codec_context.name == "aac"
        decoded = np.stack([
            f.reformat(format="rgb24", src_colorspace=Colorspace.ITU709, src_color_range=ColorRange.MPEG).to_ndarray()
            for f in container.decode(video=0)
        ]).astype(np.float32)
    assert decoded.shape == (22, 32, 48, 3)
    mse = np.mean((decoded - rgb8(video).astype(np.float32)) ** 2)
    assert 10 * np.log10(255**2 / mse) > 30  # the NV12 conversion and the packets' order are right


def test_a_requests_codec_options_override_the_servers_and_nvenc_needs_the_streamed_decode():
    server = EncoderOptions(preset="medium", crf=18, encoder="auto")
    assert server.for_request("ultrafast", None) == EncoderOptions(preset="ultrafast", crf=18)
    assert server.for_request(None, 0).crf == 0  # crf 0 (lossless) is a value, not "not given"
    assert server.for_request(None, None) == server
    nvenc_refusal(EncoderOptions(encoder="nvenc"), "stream")
    with pytest.raises(ValueError, match="--video-encoder nvenc needs --decode-mode stream"):
        nvenc_refusal(EncoderOptions(encoder="nvenc"), "full")
