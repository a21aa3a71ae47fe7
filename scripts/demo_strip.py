"""The README's picture of `make demo`'s output: a strip of frames and the stereo spectrogram, under the prompt.

    python scripts/demo_strip.py demo.mp4 docs/demo_strip.png [--prompt PROMPT]
    python scripts/demo_strip.py fl2va.mp4 docs/demo_strip_fl2va.png --prompt PROMPT --keyframe first.png

Frames are taken evenly over the clip (nearest-neighbour, 2x); the spectrogram shows both channels (the pan follows
the object) and the clicks of the bounces as vertical lines. With `--keyframe` (an FL2VA request's first keyframe,
or its last with `--anchor last`) the keyframe, fitted to the frame size, leads (or ends) the strip, marked in red.
"""

from __future__ import annotations

import argparse

import matplotlib
import numpy as np
from PIL import Image

from h3serve.demo.shipped import DEMO_PROMPT
from h3serve.rules import limits
from h3serve.tools.clip_compare import decode_mp4

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402

FRAMES = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("video")
    parser.add_argument("out")
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--keyframe", help="the FL2VA request's keyframe image, shown beside the frames")
    parser.add_argument("--anchor", choices=("first", "last"), default="first", help="which frame it pins")
    args = parser.parse_args()

    clip = decode_mp4(args.video)
    video, audio = clip.video, clip.audio
    picks = np.linspace(0, len(video) - 1, FRAMES).round().astype(int)
    tiles = [np.pad(video[i], ((2, 2), (2, 2), (0, 0)), constant_values=1.0) for i in picks]
    labels = [f"{i / limits.FPS:.1f}s" for i in picks]
    if args.keyframe:
        height, width = video.shape[1:3]
        key = np.asarray(Image.open(args.keyframe).convert("RGB").resize((width, height)), np.float32) / 255.0
        tile = np.pad(key, ((2, 2), (2, 2), (0, 0)))
        red = (1.0, 0.0, 0.0)
        tile[:2], tile[-2:], tile[:, :2], tile[:, -2:] = red, red, red, red
        tiles, labels = ([tile, *tiles], ["keyframe", *labels]) if args.anchor == "first" else (
            [*tiles, tile], [*labels, "keyframe"])
    strip = np.concatenate(tiles, axis=1)

    fig = plt.figure(figsize=(9, 3.6))
    grid = fig.add_gridspec(3, 1, height_ratios=[1.3, 1, 1], hspace=0.45)
    top = fig.add_subplot(grid[0])
    top.imshow(strip, interpolation="nearest")
    top.set_title(f'"{args.prompt}"', fontsize=10)
    top.set_xticks([(i + 0.5) * strip.shape[1] / len(tiles) for i in range(len(tiles))])
    top.set_xticklabels(labels, fontsize=7)
    top.set_yticks([])
    for row, (channel, name) in enumerate(zip(audio, ("left", "right"), strict=True), start=1):
        ax = fig.add_subplot(grid[row])
        ax.specgram(channel, NFFT=512, Fs=limits.AUDIO_SAMPLE_RATE, noverlap=384, cmap="magma", vmin=-120)
        ax.set_ylim(0, 6000)
        ax.set_ylabel(f"{name}\nHz", fontsize=7)
        ax.tick_params(labelsize=7)
    ax.set_xlabel("seconds", fontsize=7)
    fig.savefig(args.out, dpi=100, bbox_inches="tight")


if __name__ == "__main__":
    main()
