"""Where a streamed decode's frames go (`--decode-mode stream`): an MP4 written as the chunks come.

`Mp4Sink` is the pipeline's `FrameSink` on rank 0 (or in-process): it opens an `Mp4Writer` with the already
decoded soundtrack; for a decode on a GPU on the encoder's own thread (h3serve.media.encode_thread), which encodes
each uint8 chunk while the decode goes on with the next; for a decode on the CPU inline, after it. It keeps only
the few frames the previews show.
`DiscardSink` is what the other ranks pass: they decode their VAE tiles in step but receive no frames. Several
outputs of one request go to `for_output(i)`: a sink beside this one (`name.i.mp4`), listed by `outputs()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from h3serve.media.encode_thread import EncodeThread, InlineEncoder, inline_encoder
from h3serve.media.mp4 import EncoderOptions, Mp4Writer
from h3serve.media.nvenc import NvencMp4Writer, choose_encoder, say_once
from h3serve.media.previews import preview_indices, write_previews
from h3serve.rules import limits


def indexed_path(path: str | Path, index: int) -> Path:
    """Where output `index` of several goes beside `path`: out.mp4, out.1.mp4, out.2.mp4..."""
    path = Path(path)
    return path if index == 0 else path.with_name(f"{path.stem}.{index}{path.suffix}")


class _PreviewKeeper:
    """Passes frames on to the writer and copies out the preview frames (to the host) as they go by."""

    def __init__(self, writer: Mp4Writer, wanted: set[int], kept: dict[int, np.ndarray]):
        self.writer, self.wanted, self.kept = writer, wanted, kept

    def write(self, frames: np.ndarray | torch.Tensor) -> None:
        first = self.writer.written
        self.writer.write(frames)
        for i in self.wanted & set(range(first, first + frames.shape[0])):
            frame = frames[i - first]
            self.kept[i] = frame.cpu().numpy() if isinstance(frame, torch.Tensor) else frame.copy()


class Mp4Sink:
    """A `FrameSink` that writes the MP4 at `path` (atomically) and, with `previews`, the thumbnail and the
    spritesheet next to it (`write_previews`)."""

    def __init__(
        self,
        path: str | Path,
        options: EncoderOptions = EncoderOptions(),  # noqa: B008 (frozen)
        previews: bool = False,
        batch_frames: int = 1,
        device: torch.device | str = "cpu",
    ):
        """`batch_frames`: the encoder thread takes the frames in batches of at least this many (whole clips).
        `device`: where the decode's frames are (NVENC, h3serve.media.nvenc, takes them there)."""
        self.path = Path(path)
        self.options = options
        self.previews = previews
        self.batch_frames = batch_frames
        self.device = torch.device(device)
        self.kept: dict[int, np.ndarray] = {}
        self.num_frames = 0
        self.more: dict[int, Mp4Sink] = {}  # outputs 1.. of several, by index

    def for_output(self, index: int) -> Mp4Sink:
        """The sink of output `index` (>= 1) of several: `<stem>.<index><suffix>` beside this one."""
        if index not in self.more:
            self.more[index] = Mp4Sink(indexed_path(self.path, index), self.options, self.previews, self.batch_frames,
                                       self.device)
        return self.more[index]

    @contextmanager
    def open(
        self, num_frames: int, height: int, width: int, audio: np.ndarray
    ) -> Iterator[EncodeThread | InlineEncoder]:
        """The file's writer: write each clip's frames as they are decoded. A decode on a device hands them to the
        encoder's own thread (it encodes while the next clip decodes); a decode on the CPU to an `InlineEncoder`
        (held, then encoded in this thread: the cores are the decode's too). The file is whole (or, after an error
        on either side, absent) when the block ends."""
        self.num_frames = num_frames
        wanted = set(preview_indices(num_frames)) if self.previews else set()
        nvenc = choose_encoder(self.options, self.device) == "nvenc"
        if not nvenc:
            threads = self.options.threads or "auto"
            say_once(f"video encoder: x264 (preset {self.options.preset}, crf {self.options.crf}, threads {threads})")

        @contextmanager
        def writer() -> Iterator[_PreviewKeeper]:
            args = (self.path, num_frames, height, width, audio, limits.FPS, limits.AUDIO_SAMPLE_RATE, self.options)
            with NvencMp4Writer(*args, device=self.device) if nvenc else Mp4Writer(*args) as mp4:
                yield _PreviewKeeper(mp4, wanted, self.kept)

        if self.device.type == "cpu":  # the decode shares the encoder's cores: never beside it
            with inline_encoder(writer) as inline:
                yield inline
            return
        with EncodeThread(writer, batch_frames=self.batch_frames, on_device=nvenc) as encoder:
            yield encoder

    def files(self) -> dict[str, str]:
        """The files written, by download variant (the previews written now, from the kept frames)."""
        written = {"video": str(self.path)}
        if self.previews:
            previews = write_previews(self.path.parent, self.kept, self.num_frames, prefix=f"{self.path.stem}.")
            written |= {name: str(p) for name, p in previews.items()}
        return written

    def outputs(self) -> list[dict[str, str]]:
        """`files()` of every output, in index order (one entry for a single output)."""
        return [self.files(), *(self.more[i].files() for i in sorted(self.more))]


class _Drop:
    on_device = False
    span = None

    def write(self, frames: np.ndarray) -> None:
        pass


class DiscardSink:
    """A `FrameSink` for the ranks whose frames are not wanted (only rank 0's output leaves the engine)."""

    @contextmanager
    def open(self, num_frames: int, height: int, width: int, audio: np.ndarray) -> Iterator[_Drop]:
        yield _Drop()

    def for_output(self, index: int) -> DiscardSink:
        return self



class Mp4Chunks:
    """A real-time session's chunks into one MP4 at `path` as they come (`h3serve generate --realtime-lora`): each
    chunk's frames and the audio that goes with them, a `SegmentWriter` whose segments stay in the file."""

    def __init__(self, path: str | Path, num_frames: int, width: int, height: int, options: EncoderOptions):
        self.writer = Mp4Writer(path, num_frames, height, width, np.zeros((2, 0), np.float32), limits.FPS,
                                limits.AUDIO_SAMPLE_RATE, options, audio_follows=True)
        self.writer.__enter__()

    def segment(self, frames: np.ndarray, audio: np.ndarray) -> bytes:
        """uint8 frames [t, H, W, 3] and their float32 audio [S, 2]."""
        self.writer.append_audio(audio.T)
        self.writer.write(frames)
        return b""

    def finish(self) -> bytes:
        self.writer.__exit__(None, None, None)
        return b""

    def abort(self) -> None:
        """Leave no file (the session failed)."""
        error = RuntimeError("the session did not finish")
        self.writer.__exit__(type(error), error, None)
