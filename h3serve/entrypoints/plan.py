"""`h3serve plan [MODEL_DIR | --preset released] [engine flags]`: will it fit, before a weight is downloaded.

Reads shapes only (configs; models built on the meta device), so `--preset released` answers for the real
134 GB checkpoint on a laptop, with no GPU and no torch.distributed. Exit 0 when the plan fits (or no
--device-memory was given), 1 when it does not fit, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from h3serve.entrypoints.cli_util import EXIT_USAGE, fail, model_dir

EXIT_DOES_NOT_FIT = 1
PRESETS = ("released",)


def register(sub: argparse._SubParsersAction) -> None:
    from h3serve.entrypoints.engine_args import add_engine_args
    from h3serve.offload.measured_engine import ENGINES, H3SERVE

    p = sub.add_parser("plan", help="per rank and stage, the device and host memory a configuration needs")
    p.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="checkpoint folder (configs are read, no weights)")
    p.add_argument("--preset", help="released: the released H3 architecture, no files needed")
    p.add_argument("--width", type=int, help="multiple of 32 (default: the checkpoint's 16:9 canvas)")
    p.add_argument("--height", type=int, help="multiple of 32")
    p.add_argument("--duration", type=float, help="seconds, 4-15, snapped up to 17n+5 frames (default 5)")
    p.add_argument("--task", help="t2va | fl2va | ref2va (default: the served task that needs the most memory)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length in tokens (default 256)")
    p.add_argument("--headroom", default="1GiB", help="kept free above the peak for a 'fits' verdict (default 1GiB)")
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.add_argument(
        "--as-engine",
        default=H3SERVE,
        help=f"{' | '.join(ENGINES)} (default {H3SERVE}): plan as that engine runs the configuration; vllm-omni: its "
        "fp32 video VAE, whole-video decode, encoder layout and communicators, to compare with figures measured on it",
    )
    add_engine_args(p)
    p.set_defaults(func=cmd_plan)


def plan_parser() -> argparse.ArgumentParser:
    """A parser holding only `plan`: other commands plan with its flags (the selftest, the acceptance run)."""
    parser = argparse.ArgumentParser(prog="h3serve")
    register(parser.add_subparsers())
    return parser


def plan_from_argv(argv: list[str]):
    """The plan `h3serve plan ARGV` prints."""
    return build_plan(plan_parser().parse_args(["plan", *argv]))[0]


def _source(args: argparse.Namespace) -> str | Path:
    from h3serve.offload.inventory import RELEASED

    if args.preset is not None:
        if args.preset not in PRESETS:
            raise ValueError(f"--preset: unknown preset {args.preset!r}; choose from: {', '.join(PRESETS)}")
        if args.model_dir:
            raise ValueError("give MODEL_DIR or --preset, not both")
        return RELEASED
    return model_dir(args.model_dir)


def _device(args: argparse.Namespace):
    """Plans are for the target device, not this machine: auto means CUDA."""
    import torch

    from h3serve.config.engine_config import DTYPES
    from h3serve.errors import ConfigError

    if args.device == "cpu":
        kind = "cpu"
    elif args.device in ("auto", "cuda") or args.device.startswith("cuda:"):
        kind = "cuda"
    else:
        raise ConfigError(f"--device: unknown device {args.device!r}; choose from: auto, cpu, cuda, cuda:N")
    if args.dtype == "auto":
        return kind, None
    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype: unknown dtype {args.dtype!r}; choose from: auto, {', '.join(DTYPES)}")
    return kind, getattr(torch, args.dtype)


def _shapes(args: argparse.Namespace, defaults, tasks: tuple[str, ...]):
    """Request shapes to plan, checked by the request rules (placeholder media stand in for keyframes/references)."""
    from h3serve.offload.activations import RequestShape
    from h3serve.rules.request import GenerationRequest, MediaRef
    from h3serve.rules.validate import validate

    if args.task is not None and args.task not in tasks:
        raise ValueError(f"--task {args.task}: the loaded DiTs serve {', '.join(tasks)}; choose one of them")
    shapes = []
    placeholder = MediaRef(path=Path("placeholder"), name="placeholder", kind="image")
    for task in [args.task] if args.task else tasks:
        request = GenerationRequest(
            prompt="plan",
            width=args.width,
            height=args.height,
            duration_s=args.duration,
            task=task,
            image=placeholder if task == "fl2va" else None,
            last_image=placeholder if task == "fl2va" else None,
            references=(placeholder,) if task == "ref2va" else (),
        )
        plan = validate(request, defaults)
        shapes.append(
            RequestShape(
                plan.width,
                plan.height,
                plan.num_frames,
                task,
                args.prompt_tokens,
                streamed_decode=args.decode_mode == "stream",
            )
        )
    return shapes


def build_plan(args: argparse.Namespace):
    """(plan, title) for the parsed flags; raises the usual configuration errors."""
    from h3serve.checkpoint.resolver import read_layout
    from h3serve.config.engine_config import DECODE_MODES, EngineConfig
    from h3serve.config.offload_config import parse_bytes
    from h3serve.entrypoints.engine_args import (
        adaln_memo,
        denoise_chunk_rows,
        device_memory,
        layout_fields,
        offload_config,
        prompt_cache,
        quantization,
    )
    from h3serve.offload.inventory import RELEASED, build_inventory
    from h3serve.offload.measured_engine import H3SERVE, check_engine
    from h3serve.offload.model_configs import model_dims
    from h3serve.offload.planner import Runtime
    from h3serve.offload.realtime_kv import realtime_kv_bytes, with_realtime_cache
    from h3serve.offload.request_shapes import plan_largest, served_tasks
    from h3serve.parallel.degrees import ParallelDegrees, check_degrees
    from h3serve.rules import limits
    from h3serve.rules.adapter_choice import FASTH3_TASKS
    from h3serve.rules.names import TASK_TYPE_ALIASES
    from h3serve.rules.validate import ModelDefaults

    if args.task_type not in TASK_TYPE_ALIASES:
        raise ValueError(f"--task-type: unknown {args.task_type!r}; choose from: {', '.join(TASK_TYPE_ALIASES)}")
    if args.decode_mode not in DECODE_MODES:
        raise ValueError(f"--decode-mode {args.decode_mode}: choose from: {', '.join(DECODE_MODES)}")
    if args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    source = _source(args)
    # Not validated as a whole (the released preset has no folder): it supplies the DiTs and the degrees.
    draft = EngineConfig(model=Path(source), **layout_fields(args))
    dits = draft.dits
    offload = offload_config(args)
    degrees = ParallelDegrees.of(draft)
    memory = device_memory(args.device_memory)
    headroom = parse_bytes(args.headroom, "--headroom") if memory else 0
    check_degrees(degrees, model_dims(source, dits), args.cfg_parallel_size, args.vae_parallel_mode)
    device, dtype = _device(args)
    quant = quantization(args)
    base = Path(args.base_checkpoint) if getattr(args, "base_checkpoint", None) else None  # a FastH3 V2 tree's VAEs
    inv = build_inventory(source, degrees, dits, device, dtype, quant, check_engine(args.as_engine), base=base)
    defaults = ModelDefaults() if source == RELEASED else read_layout(source, dits, base=base).defaults()
    store = adaln_memo(args.adaln_memo)
    # Compiled as the engine would on the planned device: regional torch.compile on CUDA unless --enforce-eager.
    compiled = device == "cuda" and not args.enforce_eager
    vsa = (args.diffusion_attention_backend or "") == "FASTVIDEO_VSA"  # its tile buffers count in the denoise stage
    runtime = Runtime(memo=store is not None, memo_store=store or 0, compiled=compiled,
                      denoise_chunk_rows=denoise_chunk_rows(args.denoise_chunk_rows), vsa=vsa,
                      prompt_cache=prompt_cache(getattr(args, "prompt_cache", None)) or 0)
    tasks = served_tasks(inv)
    if defaults.distilled_checkpoint is not None:  # a distilled checkpoint (FastH3 V2) serves its own tasks only
        tasks = tuple(t for t in tasks if t in FASTH3_TASKS)
    plan = plan_largest(inv, offload, _shapes(args, defaults, tasks), memory, headroom, runtime=runtime)
    realtime = getattr(args, "realtime_lora", None) is not None and "transformer" in inv.dits
    if realtime:  # a session's clean K/V cache at --width/--height, else the real-time default canvas
        width, height = args.width or limits.REALTIME_DEFAULT_SIZE[0], args.height or limits.REALTIME_DEFAULT_SIZE[1]
        kv = realtime_kv_bytes(inv.dits["transformer"], degrees.ulysses, inv.element_size, width, height)
        plan = with_realtime_cache(plan, kv)
    layout = f"tp {degrees.tensor_parallel}, ulysses {degrees.ulysses}, ring {degrees.ring}, "
    layout += f"text-encoder tp {degrees.text_encoder_tp}, vae patch parallel {degrees.vae_patch_parallel}"
    name = "released H3 architecture (no files)" if source == RELEASED else str(source)
    memo_text = "AdaLN memo on" if runtime.memo else "AdaLN memo off"
    compile_text = "compiled" if compiled else "eager"
    title = f"plan: {name}; {degrees.world_size} rank(s) ({layout}); {offload.describe()}; {memo_text}; {compile_text}"
    if quant is not None:
        title += f"; quantization {quant.describe()}"
    if realtime:
        title += f"; a real-time session at {width}x{height}"
    if inv.engine != H3SERVE:
        title += f"; as {inv.engine} runs it"
    return plan, title


def cmd_plan(args: argparse.Namespace) -> int:
    from h3serve.checkpoint.resolver import CheckpointError
    from h3serve.errors import ConfigError
    from h3serve.offload.plan_report import format_plan, plan_json
    from h3serve.rules.validate import RequestError

    try:
        plan, title = build_plan(args)
    except (ConfigError, CheckpointError, RequestError, ValueError) as e:  # OffloadError is a ValueError
        return fail(str(e), EXIT_USAGE)
    if args.json:
        print(json.dumps({"title": title, **plan_json(plan)}, indent=2))
    else:
        print(format_plan(plan, title))
    if plan.fits is False:
        print(f"error: does not fit by {plan.shortfall_bytes / 2**30:.2f} GiB", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0
