"""`h3serve generate`: one request from the command line, through the same GenerationRequest as HTTP, into MP4s."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

from h3serve.entrypoints.cli_util import EXIT_ERROR, fail, model_dir
from h3serve.rules import limits
from h3serve.rules.names import (
    AUDIO_MODES,
    CONTROL_TYPES,
    DEFAULT_CRF,
    DEFAULT_SAMPLE_SOLVER,
    DEFAULT_X264_PRESET,
    LONG_VIDEO_MODES,
    SAMPLE_SOLVERS,
    TASKS,
    VIDEO_ENCODERS,
)


def format_stages(durations: dict[str, float], timeline: list[tuple[str, float, float]] | None = None) -> str:
    """One line: 'text_encode 0.10s @0.00-0.10 | denoise 2.31s (0.33s/step) @0.10-2.41 | ...': each stage's time and,
    from `timeline` ((stage, start, end) on one clock), when it ran, in seconds from the first stage's start (its
    first start to its last end: a stage that ran beside another overlaps it)."""
    origin = min((start for _, start, _ in timeline), default=0.0) if timeline else 0.0
    when: dict[str, tuple[float, float]] = {}
    for name, start, end in timeline or ():
        first, last = when.get(name, (start, end))
        when[name] = (min(first, start), max(last, end))
    order = sorted(durations, key=lambda n: when[n][0] if n in when else float("inf"))
    parts = []
    for name in order:
        if name == "denoise_per_step":
            continue
        part = f"{name} {durations[name]:.2f}s"
        if name == "denoise" and "denoise_per_step" in durations:
            part += f" ({durations['denoise_per_step']:.3f}s/step)"
        if name in when:
            part += f" @{when[name][0] - origin:.2f}-{when[name][1] - origin:.2f}"
        parts.append(part)
    return " | ".join(parts)


# ------------------------------------------------------------------------------------------------------------
# generate
# ------------------------------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    from h3serve.entrypoints.engine_args import add_engine_args
    from h3serve.media.mp4 import VIDEO_ENCODER_HELP

    p = sub.add_parser("generate", help="generate one MP4 (video + stereo audio) from a prompt")
    p.add_argument("prompt")
    p.add_argument("-o", "--output", required=True, help="output .mp4 path")
    p.add_argument("--model", help="checkpoint folder (default: the tiny checkpoint, built on first use)")
    p.add_argument("--aspect-ratio", help="W:H (16:9), a number (1.7778) or auto; beside --width/--height it must "
                   "agree with them (h3serve/rules/canvas.py)")
    p.add_argument("--short-edge", type=int, help="canvas mode 768 (the checkpoint's canvas) or 1440")
    p.add_argument("--width", type=int, help="multiple of 32; with --height")
    p.add_argument("--height", type=int, help="multiple of 32")
    p.add_argument(
        "--duration", type=float, help="seconds, 4-15 (30 / 300 with --long-video), snapped up to 17n+5 (default 5); "
        "with --realtime-lora up to 600, in whole 5-second requests"
    )
    p.add_argument("--steps", type=int, help="denoiser forwards N, 1-200 (diffusers' N+1 points; default 50)")
    p.add_argument("--lora", metavar="PATH", help="a LoRA adapter file or directory, applied unmerged (--lora-scale S)")
    p.add_argument("--seed", type=int, help="default 42")
    p.add_argument("--num-outputs", type=int, metavar="N",
                   help=f"outputs of the prompt, 1-{limits.MAX_OUTPUTS_PER_PROMPT} (default 1): output i is the "
                   "request at seed + i, written to OUTPUT for i = 0 and beside it as NAME.i.mp4 (out.1.mp4, ...)")
    p.add_argument("--flow-shift", type=float, help="video sigma shift (default: the checkpoint's, 12)")
    p.add_argument("--audio-flow-shift", type=float, help="audio sigma shift (default: the checkpoint's, 3)")
    p.add_argument(
        "--sample-solver", metavar="{" + ",".join(SAMPLE_SOLVERS) + "}",
        help=f"sampler (any case; default {DEFAULT_SAMPLE_SOLVER}): res_multistep is ComfyUI's second-order RES "
        "multistep (its first step and the step to sigma 0 are Euler); a few-step adapter runs euler only",
    )
    p.add_argument("--image", metavar="FIRST", help="FL2VA first keyframe (image file)")
    p.add_argument("--last-image", metavar="LAST", help="FL2VA last keyframe (image file)")
    for kind in ("image", "video", "audio"):
        p.add_argument(
            f"--ref-{kind}",
            dest="references",
            action=_AppendReference,
            kind=kind,
            metavar="FILE",
            help=f"Ref2VA {kind} reference (repeatable; references keep their command-line order)",
        )
    p.add_argument("--task", choices=TASKS, help="default: from the inputs")
    p.add_argument("--long-video", action="store_const", const=True, help="allow up to 30 s (full) or 300 s")
    p.add_argument("--long-video-mode", choices=LONG_VIDEO_MODES, help="default: continuation for ref2va")
    p.add_argument("--window-frames", type=int, help="continuation window, 17n+5 in 107-345 (default 277)")
    p.add_argument("--overlap-frames", type=int, help="continuation overlap, 17n+5 below the window (default 22)")
    p.add_argument(
        "--continuation-prompt", action="append", metavar="TEXT",
        help="one per window, in order (repeat); each is appended to the main prompt for its window",
    )
    p.add_argument(
        "--guide", action="append", metavar="INDEX=FILE",
        help="a timeline guide (repeatable): an image, a clip or a sound placed at output frame INDEX, counted from "
        "the end when negative (-1: the last frame); e.g. --guide 36=red.png --guide -22=ending.mp4",
    )
    p.add_argument("--control", metavar="TYPE[=FILE]",
                   help=f"a control video for the ControlNet (--controlnet-model-path): TYPE one of "
                   f"{', '.join(CONTROL_TYPES)}, FILE the control video (inpaint: --control-mask instead)")
    p.add_argument("--control-mask", metavar="FILE", help="control: the mask (image or gray video, white = regenerate)")
    p.add_argument("--control-source", metavar="FILE", help="control: the source video kept outside the mask")
    p.add_argument("--control-scale", type=float, help="control: control_context_scale, >= 0 (default 1; 0: off)")
    p.add_argument("--source-video", metavar="FILE", help="latent-mask editing: the video to edit (MP4/MOV)")
    p.add_argument("--source-audio", metavar="FILE", help="latent-mask editing / lock_source: the audio (WAV/MP3)")
    p.add_argument("--video-noise-mask", metavar="JSON", help="JSON text or a .json file: 1 = generate, 0 = keep")
    p.add_argument("--audio-noise-mask", metavar="JSON", help="JSON text or a .json file on the audio latent grid")
    p.add_argument("--audio-mode", choices=AUDIO_MODES, help="lock_source: the driving audio is kept")
    p.add_argument(
        "--start-time", type=float, action="append", metavar="SECONDS",
        help="ref2va: trim reference videos before this time (once for all, or once per --ref-video, in order)",
    )
    p.add_argument("--extend", metavar="VIDEO", help="continue this video (--duration: the new part; --long-video)")
    p.add_argument("--save-raw", metavar="RAW.npz", help="also save the float32 video/audio arrays muxed into the MP4")
    p.add_argument("--x264-preset", default=DEFAULT_X264_PRESET,
                   help=f"x264 preset (default {DEFAULT_X264_PRESET}; with --crf {DEFAULT_CRF}: medium's quality at "
                        "CRF 18 or better, for a fraction of its CPU)")
    p.add_argument("--crf", type=int, default=DEFAULT_CRF,
                   help=f"x264 constant rate factor (default {DEFAULT_CRF}; lower is better; NVENC's constant QP)")
    p.add_argument("--audio-bitrate", type=int, default=192_000, help="AAC bitrate in bit/s (default 192000)")
    p.add_argument("--video-encoder", choices=VIDEO_ENCODERS, default="auto", help=VIDEO_ENCODER_HELP)
    add_engine_args(p)  # device, parallel layout (--num-gpus, --usp, ...), vLLM-Omni recipe flags
    p.set_defaults(func=cmd_generate)


class _AppendReference(argparse.Action):
    """--ref-image/--ref-video/--ref-audio all append to one ordered list of (kind, path)."""

    def __init__(self, *args, kind: str, **kwargs):
        self.kind = kind
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        refs = list(getattr(namespace, self.dest, None) or [])
        refs.append((self.kind, values))
        setattr(namespace, self.dest, refs)


def _media(path: str | None, kind: str | None = None):
    from h3serve.rules.request import MediaRef

    return None if path is None else MediaRef(path=Path(path), name=path, kind=kind)


def _request_from_args(args: argparse.Namespace):
    from h3serve.rules.request import GenerationRequest

    return GenerationRequest(
        prompt=args.prompt,
        width=args.width,
        height=args.height,
        aspect_ratio=args.aspect_ratio,
        short_edge=args.short_edge,
        duration_s=args.duration,
        steps=args.steps,
        seed=args.seed,
        num_outputs=args.num_outputs,
        flow_shift=args.flow_shift,
        audio_flow_shift=args.audio_flow_shift,
        sample_solver=args.sample_solver,
        task=args.task,
        image=_media(args.image, "image"),
        last_image=_media(args.last_image, "image"),
        references=tuple(_media(path, kind) for kind, path in (args.references or [])),
        continuation_window_frames=args.window_frames,
        continuation_overlap_frames=args.overlap_frames,
        continuation_prompts=None if args.continuation_prompt is None else tuple(args.continuation_prompt),
        source_video=_media(args.source_video, "video"),
        source_audio=_media(args.source_audio, "audio"),
        video_noise_mask=_mask(args.video_noise_mask, "--video-noise-mask"),
        audio_noise_mask=_mask(args.audio_noise_mask, "--audio-noise-mask"),
        audio_mode=args.audio_mode,
        start_time_seconds=None if args.start_time is None else tuple(args.start_time),
        extend_video=_media(args.extend, "video"),
        long_video=True if args.extend else args.long_video,
        long_video_mode="continuation" if args.extend else args.long_video_mode,
        control=_control(args),
        guides=tuple(_guide(text) for text in args.guide or ()),
    )


def _guide(text: str):
    """`--guide INDEX=FILE` as a timeline guide; the file's kind (image, clip or sound) from its bytes."""
    from h3serve.media.sniff import sniff
    from h3serve.rules.request import MediaRef, TimelineGuide
    from h3serve.rules.validate import RequestError

    index, _, path = text.partition("=")
    try:
        frame = int(index.strip())
    except ValueError:
        frame = None
    if frame is None or not path:
        raise RequestError("--guide", f"expects INDEX=FILE (an output frame, negative from the end), got {text!r}")
    kind = sniff(path)
    if kind is None:
        raise RequestError("--guide", f"{path}: not a readable image, video or audio file")
    ref = MediaRef(path=Path(path), name=path, kind=kind)
    return TimelineGuide(frame, audio=ref) if kind == "audio" else TimelineGuide(frame, visual=ref)


def _control(args: argparse.Namespace):
    """`--control TYPE[=FILE]` with its mask, source and scale as the request's control (None without it)."""
    from h3serve.rules.request import ControlRequest

    if args.control is None:
        for flag, value in (("--control-mask", args.control_mask), ("--control-source", args.control_source),
                            ("--control-scale", args.control_scale)):
            if value is not None:
                raise ValueError(f"{flag} needs --control TYPE[=FILE]")
        return None
    kind, _, file = args.control.partition("=")
    return ControlRequest(type=kind.strip().lower(), control=_media(file or None, "video"),
                          source=_media(args.control_source, "video"), mask=_media(args.control_mask),
                          scale=args.control_scale)


def _with_lora(request, args: argparse.Namespace, config):
    """`--lora PATH`: the engine preloads PATH (engine_config_from_args); the request names it."""
    if not args.lora:
        return request
    import dataclasses

    from h3serve.adapters.catalog import LoraField, parse_lora_paths
    from h3serve.adapters.serving import catalog_for

    [(name, _)] = parse_lora_paths([args.lora])
    choice = catalog_for(config).choose(LoraField(name=name, scale=args.lora_scale))
    return dataclasses.replace(request, lora=choice)


def _mask(text: str | None, flag: str):
    """A mask from JSON text, or from a file holding it (a value that does not start like JSON is a path)."""
    from h3serve.rules.edit_mask import MaskError, parse_mask_json
    from h3serve.rules.validate import RequestError

    if text is None:
        return None
    try:
        if text.strip()[:1] in "[0123456789.-" and text.strip():
            return parse_mask_json(text)
        return parse_mask_json(Path(text).read_bytes())
    except OSError as e:
        raise RequestError(flag, f"cannot read {text}: {e.strerror}") from None
    except MaskError as e:
        raise RequestError(flag, str(e)) from None


def _check_writable(flag: str, path: str | None) -> None:
    """Refuse an output path that cannot be written before any work is done (not after a long generation)."""
    from h3serve.errors import ConfigError

    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag}: {path} is a directory; give a file name")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise ConfigError(f"{flag}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag}: folder {folder} is not writable")


def cmd_generate(args: argparse.Namespace) -> int:
    from h3serve.adapters.serving import engine_defaults
    from h3serve.checkpoint.resolver import read_layout
    from h3serve.engine.planning import plan_request
    from h3serve.entrypoints.engine_args import engine_config_from_args
    from h3serve.errors import ConfigError, H3ServeError
    from h3serve.media.mp4 import EncoderOptions, nvenc_refusal
    from h3serve.rank.device_checks import check_engine
    from h3serve.rank.model_runner import guide_serving
    from h3serve.rank.placement import device_memory_of, long_request_refusal
    from h3serve.rules.request import tasks_served

    # Everything that can be refused is refused here, before a weight is read.
    try:
        options = EncoderOptions(preset=args.x264_preset, crf=args.crf, audio_bitrate=args.audio_bitrate,
                                 encoder=args.video_encoder)
        options.validate()
        _check_writable("--output", args.output)
        _check_writable("--save-raw", args.save_raw)
        model = model_dir(args.model)
        config = engine_config_from_args(args, model)
        setup = check_engine(config)  # the ranks' own start-up check, before any rank starts
        device = setup.device
        if config.realtime_lora is not None:  # a real-time session, offline (h3serve.entrypoints.generate_realtime)
            from h3serve.entrypoints.generate_realtime import generate_realtime

            defaults = read_layout(model, config.dits, base=config.base_checkpoint).defaults()
            return generate_realtime(args, config, defaults, options)
        if args.save_raw and config.decode_mode == "stream":  # the float arrays exist only in a full decode
            config = dataclasses.replace(config, decode_mode="full")
        nvenc_refusal(options, config.decode_mode)
        layout = read_layout(model, config.dits, base=config.base_checkpoint)
        tasks = tasks_served(d for d in config.dits if layout.has(d))
        defaults = dataclasses.replace(engine_defaults(config, layout.defaults()), server_cache=config.server_cache)
        defaults = guide_serving(config, defaults, setup.attention.get("self"))  # as the ranks' defaults
        plan = plan_request(_with_lora(_request_from_args(args), args, config), defaults, tasks)
        refusal = long_request_refusal(config, plan, device_memory_of(config, device))
        if refusal is not None:  # the planner's verdict, before a weight is read
            return fail(f"duration: {refusal}")
    except (H3ServeError, ValueError) as e:
        return fail(str(e))
    windows = f", {len(plan.windows)} continuation windows" if plan.windows else ""
    print(
        f"{plan.width}x{plan.height}, {plan.num_frames} frames ({plan.duration_s:.3f} s), "
        f"{plan.steps} steps (forwards), seed {plan.seed}{windows}, model {model}",
        file=sys.stderr,
    )
    try:
        output = _run_engine(config, plan, args.output, options)
    except ConfigError as e:  # the placement plan refused the configuration, before any weight was read
        return fail(str(e))
    except Exception as e:  # one line, never a traceback: the request was valid, the run failed
        return fail(f"generation failed: {type(e).__name__}: {e}", EXIT_ERROR)
    if output is None:
        print("this node's ranks ran their part of the request; the node with rank 0 writes the output",
              file=sys.stderr)
        return 0
    return _write_outputs(args, output, options)


def _run_engine(config, plan, output_path, options):
    """Load the weights (in-process, or one process per rank) and run one plan with a progress bar; streamed
    (`--decode-mode stream`), the MP4 is written at `output_path` as the VAE clips are decoded.

    On several nodes (torchrun, or NNODES/NODE_RANK: h3serve.parallel.rendezvous) every node runs the same
    command: the node with rank 0 runs the request and returns its output; the others only host their ranks
    until it is done, and return None."""
    from tqdm import tqdm

    from h3serve.engine.executor import Executor
    from h3serve.media.sink import Mp4Sink, indexed_path
    from h3serve.rank.model_runner import ModelRunner

    multi_rank = config.world_size > 1  # one process per rank; this process only submits and collects
    engine = Executor(config) if multi_rank else ModelRunner(config)
    if multi_rank and not engine.rendezvous.is_leader:
        try:
            engine.run_follower(restart=False)
        finally:
            engine.close()
        return None
    bar = tqdm(total=None, desc="denoise", unit="step", file=sys.stderr)

    def on_step(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    stream = config.decode_mode == "stream"
    try:
        if not stream:
            return engine.generate(plan, on_progress=on_step)
        if multi_rank:
            output = engine.generate(plan, on_progress=on_step, encoder=options)
            for index, media in enumerate(output.outputs):
                files = media.files
                shutil.move(files.pop("video"), indexed_path(output_path, index))
                for path in files.values():  # previews: the server's downloads, not the CLI's
                    Path(path).unlink(missing_ok=True)
            return output
        sink = Mp4Sink(output_path, options, batch_frames=plan.preencode_batch_frames, device=engine.device)
        return engine.generate(plan, on_progress=on_step, sink=sink)
    finally:
        bar.close()
        if multi_rank:
            engine.close()


def _write_outputs(args: argparse.Namespace, output, options) -> int:
    from h3serve.media.mp4 import write_mp4
    from h3serve.media.raw import write_raw
    from h3serve.media.sink import indexed_path

    start = time.monotonic()
    try:
        for index, media in enumerate(output.outputs):
            if media.video is not None:  # else streamed: the MP4 was written during the decode
                begin = time.monotonic()
                write_mp4(indexed_path(args.output, index), media.video, media.audio, options=options)
                output.stage_durations["mux"] = time.monotonic() - start
                output.stage_timeline.append(("mux", begin, time.monotonic()))
            if args.save_raw:
                write_raw(indexed_path(args.save_raw, index), media.video, media.audio)
    except (ValueError, OSError) as e:
        return fail(f"writing the output failed: {e}", EXIT_ERROR)
    print(format_stages(output.stage_durations, output.stage_timeline), f"| peak {output.peak_memory_mb:.0f} MB",
          file=sys.stderr)
    for index in range(len(output.outputs)):
        print(indexed_path(args.output, index).resolve())
    return 0


def joined_guides(argv: list[str]) -> list[str]:
    """`--guide -22=clip.mp4` as `--guide=-22=clip.mp4`: argparse would read a value starting with "-" as a flag."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--guide" and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"--guide={arg}"
        else:
            out.append(arg)
    return out
