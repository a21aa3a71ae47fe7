"""H.264 on the GPU's video encoder (NVENC, through NVIDIA's PyNvVideoCodec: the optional `nvenc` extra), fed the
decode's frames where they are: on the device.

`choose_encoder` resolves `--video-encoder` for frames on a device: `x264` always writes with libx264; `nvenc`
needs CUDA frames, PyNvVideoCodec and a GPU with an encoder engine (the refusal says which is missing); `auto`
takes NVENC where all three are there and x264 otherwise, saying why. Data-centre GPUs without NVENC (A100, H100,
H200) therefore write with x264 under `auto`.

`NvencMp4Writer` is the `Mp4Writer` (same container, same AAC soundtrack interleaved after each frame) with the
video encoded by NVENC: each uint8 RGB frame [H, W, 3] on the device becomes BT.709 limited-range NV12 on the device
(`rgb_to_nv12`, with the 2x2 chroma average) and is handed to the encoder by its CUDA array interface; no frame
crosses to the host, only the bitstream does. Constant QP at the CRF's value, no B-frames (so packets come in
display order), one IDR at the start as x264 writes. Its bytes are NVENC's (not x264's): the same frames give the
same file on the same GPU and driver.
"""

from __future__ import annotations

import sys
from fractions import Fraction
from typing import Any

import av
import torch
from av.video.reformatter import ColorPrimaries, ColorRange, Colorspace, ColorTrc

from h3serve.media.mp4 import EncoderOptions, Mp4Writer

try:  # the optional `nvenc` extra
    import PyNvVideoCodec as nvc
except ImportError:  # pragma: no cover - depends on the install
    nvc = None

# BT.709 limited range, from 8-bit RGB: Y in [16, 235], Cb/Cr in [16, 240] (the same matrix swscale applies).
_KR, _KB = 0.2126, 0.0722
_KG = 1.0 - _KR - _KB
_Y = (219 / 255 * _KR, 219 / 255 * _KG, 219 / 255 * _KB)
_CB = (-224 / 255 * _KR / (2 * (1 - _KB)), -224 / 255 * _KG / (2 * (1 - _KB)), 224 / 255 / 2)
_CR = (224 / 255 / 2, -224 / 255 * _KG / (2 * (1 - _KR)), -224 / 255 * _KB / (2 * (1 - _KR)))

_said: set[str] = set()


def say_once(line: str) -> None:
    """Which encoder writes, on stderr, once per process and choice (the log a server keeps)."""
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr)


def nvenc_missing(device: torch.device) -> str | None:
    """Why NVENC cannot encode frames on `device` (None: it can)."""
    if device.type != "cuda":
        return f"the frames are on {device.type}, not a CUDA device"
    if nvc is None:
        return "PyNvVideoCodec is not installed (pip install 'h3serve[nvenc]', on a GPU box)"
    try:
        caps = nvc.GetEncoderCaps(gpuid=device.index or 0, codec="h264")
    except Exception as e:  # no encoder engine, or a driver without NVENC
        return f"the GPU has no usable H.264 encoder ({type(e).__name__}: {e})"
    if int(caps.get("num_encoder_engines", 1)) < 1:
        return "the GPU has no NVENC engine (A100, H100 and H200 have none)"
    return None


def choose_encoder(options: EncoderOptions, device: torch.device) -> str:
    """"x264" or "nvenc" for `options.encoder` with frames on `device`; `nvenc` asked for and impossible raises."""
    if options.encoder == "x264":
        return "x264"
    missing = nvenc_missing(device)
    if missing is None:
        return "nvenc"
    if options.encoder == "nvenc":
        raise ValueError(f"--video-encoder nvenc: {missing}")
    if device.type == "cuda":  # on a GPU, say why its frames go to x264
        say_once(f"video encoder: x264 (auto: NVENC unavailable: {missing})")
    return "x264"


def rgb_to_nv12(frame: torch.Tensor) -> torch.Tensor:
    """uint8 RGB [H, W, 3] -> NV12 [H·3/2, W] uint8 on the same device: the luma plane, then Cb/Cr interleaved at
    half resolution (each the average of its 2x2 block), BT.709 limited range, rounded to nearest."""
    height, width, _ = frame.shape
    rgb = frame.permute(2, 0, 1).float()  # [3, H, W]
    y = _mix(rgb, _Y) + 16.0
    block = rgb.view(3, height // 2, 2, width // 2, 2).mean(dim=(2, 4))  # [3, H/2, W/2]
    chroma = torch.stack((_mix(block, _CB), _mix(block, _CR)), dim=-1) + 128.0  # [H/2, W/2, 2]
    out = torch.empty((height * 3 // 2, width), dtype=torch.uint8, device=frame.device)
    out[:height] = y.round_().clamp_(16, 235).to(torch.uint8)
    out[height:] = chroma.round_().clamp_(16, 240).to(torch.uint8).view(height // 2, width)
    return out


def _mix(rgb: torch.Tensor, weights: tuple[float, float, float]) -> torch.Tensor:
    return rgb[0] * weights[0] + rgb[1] * weights[1] + rgb[2] * weights[2]


class _Nv12Frame:
    """What PyNvVideoCodec's `Encode` reads a device frame from: its planes' CUDA array interfaces."""

    def __init__(self, nv12: torch.Tensor, height: int):
        self.planes = [nv12[:height].unsqueeze(-1), nv12[height:].view(height // 2, -1, 2)]  # [H, W, 1], [H/2, W/2, 2]

    def cuda(self) -> list[torch.Tensor]:
        return self.planes


def _is_idr(data: bytes) -> bool:
    """Whether an Annex-B access unit holds an IDR slice (NAL type 5)."""
    start = data.find(b"\x00\x00\x01")
    while start != -1:
        if start + 3 < len(data) and data[start + 3] & 0x1F == 5:
            return True
        start = data.find(b"\x00\x00\x01", start + 3)
    return False


def _bitstreams(encoded: Any) -> list[bytes]:
    """`Encode` / `EndEncode` output as access units: a list of packet dicts (PyNvVideoCodec 2.x) or one buffer."""
    if isinstance(encoded, list | tuple):
        return [bytes(p["data"]) if isinstance(p, dict) else bytes(p) for p in encoded if len(p)]
    data = bytes(encoded)
    return [data] if data else []


class NvencMp4Writer(Mp4Writer):
    """`Mp4Writer` with NVENC for the video: `write` takes uint8 RGB frames [t, H, W, 3] on a CUDA device."""

    on_device = True

    def __init__(self, *args: Any, device: torch.device, encoder_factory: Any = None, **kwargs: Any):
        """`encoder_factory(width, height, options, device, frames, fps)`: the NVENC session (tests: a stand-in)."""
        super().__init__(*args, **kwargs)
        self.device = device
        self._factory = encoder_factory or _nvenc_session
        self._packets = 0

    def _open_video(self, container: Any) -> av.VideoStream:
        if self.device.type == "cuda":  # the encoder's own thread: its CUDA calls go to the frames' GPU
            torch.cuda.set_device(self.device)
        self._nvenc = self._factory(self.width, self.height, self.options, self.device, self.num_frames, self.fps)
        vstream = container.add_stream("h264", rate=self.fps)  # packets come encoded: a stream to mux them into
        vstream.width, vstream.height, vstream.pix_fmt = self.width, self.height, "yuv420p"
        vstream.time_base = Fraction(1, self.fps)
        vcc = vstream.codec_context  # the colr box: BT.709 limited range, as the x264 writer tags its stream
        vcc.colorspace, vcc.color_range = Colorspace.ITU709, ColorRange.MPEG
        vcc.color_primaries, vcc.color_trc = ColorPrimaries.BT709, ColorTrc.BT709
        say_once(f"video encoder: nvenc (h264, constant QP {self.options.crf}, on {self.device})")
        return vstream

    def _check_frames(self, frames: Any) -> None:
        if frames.dtype != torch.uint8 or frames.ndim != 4 or tuple(frames.shape[1:]) != (self.height, self.width, 3):
            raise ValueError(f"frames must be uint8 [t, {self.height}, {self.width}, 3] on the device, got "
                             f"{frames.dtype} {list(frames.shape)}")

    def _encode_video(self, frame: Any, index: int) -> list[av.Packet]:
        if frame is None:
            units = _bitstreams(self._nvenc.EndEncode())
        else:
            nv12 = rgb_to_nv12(frame)
            if nv12.is_cuda:  # NVENC reads the buffer on its own stream: the conversion must have landed
                torch.cuda.current_stream(nv12.device).synchronize()
            units = _bitstreams(self._nvenc.Encode(_Nv12Frame(nv12, self.height)))
        packets = []
        for data in units:
            packet = av.Packet(data)
            packet.stream = self._vstream
            packet.pts = packet.dts = self._packets  # no B-frames: decode order is display order
            packet.time_base = Fraction(1, self.fps)
            packet.is_keyframe = _is_idr(data)
            self._packets += 1
            packets.append(packet)
        return packets


def _nvenc_session(
    width: int, height: int, options: EncoderOptions, device: torch.device, frames: int, fps: int
) -> Any:
    """An NVENC H.264 session reading NV12 from device memory, constant QP = the CRF, no B-frames, one IDR."""
    return nvc.CreateEncoder(
        width, height, "NV12", False, codec="h264", gpu_id=str(device.index or 0), preset="P4",
        tuning_info="high_quality", rc="constqp", constqp=str(options.crf), fps=str(fps), gop=str(frames),
        idrperiod=str(frames), bf="0",
    )  # fmt: skip
