"""`h3serve bench` (the machinery is h3serve.tools.bench): tasks x shapes x engine configs, warm-up + N measured
runs, one JSON record per run, a Markdown summary and PNG plots; optionally the diffusers reference side by side
(`--peer diffusers`)."""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

EXIT_USAGE = 2


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark a matrix of tasks x shapes x engine configs (records, summary, plots)")
    p.add_argument("--matrix", metavar="FILE.yaml", help="matrix file (see benchmarks/cpu-bench.yaml); flags override")
    p.add_argument("--model", help="checkpoint folder (default: the tiny checkpoint of --preset)")
    p.add_argument("--preset", help="tiny checkpoint preset when no --model: tiny | cpu-bench (default tiny)")
    p.add_argument("--task", action="append", dest="tasks", help="t2va | fl2va | ref2va (repeatable)")
    p.add_argument(
        "--shape", action="append", dest="shapes", metavar="WxHxFRAMES", help="e.g. 448x256x124 (repeatable)"
    )
    p.add_argument(
        "--engine",
        action="append",
        dest="engines",
        metavar="K=V,...",
        help="an engine config of EngineConfig options, e.g. name=fp32,threads=2,dtype=float32 (repeatable)",
    )
    p.add_argument(
        "--steps",
        type=int,
        help="num_inference_steps: denoiser forwards (default 3; the diffusers peer runs N+1 sigma points)",
    )
    p.add_argument("--seed", type=int, help="default 0")
    p.add_argument("--prompt")
    p.add_argument("--warmup", type=int, help="warm-up runs per side and case (default 1)")
    p.add_argument("--runs", type=int, help="measured runs per side and case (default 3)")
    p.add_argument(
        "--peer", choices=["diffusers"], help="run the diffusers reference pipeline alongside, A/B alternated"
    )
    p.add_argument("--profile", action="store_true", default=None, help="one extra torch.profiler run per side")
    p.add_argument(
        "--prompt-cache",
        choices=["cold", "warm"],
        help="cold (default): every h3serve run starts with an empty prompt cache, so the text encode is always "
        "measured; warm: repeated prompts skip the encoder, as on a server",
    )
    p.add_argument("--reference", help="fidelity reference: peer | first | FILE.mp4/.npz (default: peer if any)")
    p.add_argument("--gemm-seconds", type=float, help="time budget of each same-run GEMM peak measurement (default 3)")
    p.add_argument("--out", help="output folder (default: a new folder under the h3serve cache)")
    p.add_argument("--keep-raw", action="store_true", help="keep every run's float arrays (.npz) under OUT/raw")
    p.add_argument(
        "--replicas",
        metavar="N,M,...",
        help="throughput mode: jobs/minute with N, M, ... data-parallel CPU replicas (e.g. 1,2)",
    )
    p.add_argument(
        "--overlap",
        default="on",
        metavar="on,off",
        help="throughput mode: output overlap settings to compare for each replica count (default on)",
    )
    p.add_argument(
        "--outputs",
        type=int,
        metavar="N",
        help="outputs mode: N outputs of one prompt as one DiT batch against one after another (same bits)",
    )
    p.add_argument("--jobs", type=int, default=8, help="throughput mode: timed jobs per replica count (default 8)")
    p.add_argument("--threads", type=int, default=1, help="throughput mode: CPU threads per rank (default 1)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="throughput mode: alternating timed rounds per replica count; the median counts (default 3)",
    )
    p.add_argument(
        "--dit-forward",
        action="store_true",
        help="DiT-forward mode: one forward, h3serve eager / compiled against diffusers, in one process",
    )
    p.add_argument(
        "--dit-layers",
        type=int,
        metavar="N",
        help="DiT-forward mode: random weights, the released width, N blocks (instead of a checkpoint)",
    )
    p.add_argument("--text-rows", type=int, default=128, help="DiT-forward mode: text rows in the packed sequence")
    p.add_argument(
        "--attention-backend",
        action="append",
        dest="attention_backends",
        metavar="NAME",
        help="DiT-forward mode: attention backend of the h3serve variants (repeatable; default TORCH_SDPA)",
    )
    p.add_argument(
        "--dit-modes",
        default="eager,compiled",
        metavar="eager,compiled",
        help="DiT-forward mode: the h3serve variants (default eager,compiled)",
    )
    p.add_argument(
        "--fp8-block",
        action="store_true",
        help="FP8 block mode: the error one random-weight DiT block of --preset adds in FP8 vs float32",
    )
    p.add_argument("--block-rows", type=int, default=2048, help="FP8 block mode: packed rows (default 2048)")
    p.add_argument(
        "--realtime",
        action="store_true",
        help="real-time mode: sessions of the streaming LoRA through the executor; time to first chunk, chunk "
        "interval and real-time factor (one --shape, default 64x64x243 on a tiny checkpoint)",
    )
    p.add_argument(
        "--realtime-lora",
        metavar="DIR",
        help="real-time mode: the streaming LoRA (default: a tiny one made for the tiny checkpoint's preset)",
    )
    p.add_argument(
        "--full-depth",
        action="store_true",
        help="full-depth mode (one GPU): the released DiT with random bf16 weights made on the device, a Turbo-4 "
        "T2VA request at --shape (default 1344x768x124) end to end on --model's tokenizer and, where they do not "
        "fit at the released size, its tiny text encoder and VAEs: timeline, MFU, encoders; OUT/full_depth.json",
    )
    p.add_argument(
        "--gpu-acceptance",
        action="store_true",
        help="the first command on a GPU: the selftest and every GPU row of docs/benchmarks.md, within 560 s",
    )
    p.add_argument("--json", metavar="OUT", help="GPU-acceptance mode: write the JSON record to OUT")
    p.add_argument("--table", metavar="OUT.md", help="GPU-acceptance mode: write the Markdown table to OUT.md")
    p.add_argument(
        "--budget-s", type=float, help="GPU-acceptance mode: seconds for every row together (default 560)"
    )
    p.add_argument(
        "--selftest-only",
        action="append",
        default=[],
        metavar="PREFIX",
        help="GPU-acceptance mode: pass --only PREFIX to the selftest row (repeatable; default: every check)",
    )
    p.set_defaults(func=cmd_bench)


def _default_out() -> Path:
    from h3serve.tools.tiny.make_checkpoint import cache_root

    root = cache_root() / "bench"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=root))


_FLAGS = {"tasks": "--task", "shapes": "--shape", "engines": "--engine"}  # list options: dest -> flag
_NOT_FLAGS = ("command", "func", "replicas", "overlap", "jobs", "threads", "rounds", "block_rows", "selftest_only",
              "outputs")
_DIT_FLAGS = ("text_rows", "dit_modes")  # always set (defaults): recorded in DiT-forward mode only


def command_line(args: argparse.Namespace) -> str:
    """The `h3serve bench ...` command equivalent to the parsed arguments (recorded with the results)."""
    words = ["h3serve", "bench"]
    for key, value in vars(args).items():
        if key in _NOT_FLAGS or value is None or value is False or (key in _DIT_FLAGS and not args.dit_forward):
            continue
        flag = _FLAGS.get(key, "--" + key.replace("_", "-"))
        for item in value if isinstance(value, list) else [value]:
            words += [flag] if item is True else [flag, str(item)]
    return shlex.join(words)


def cmd_throughput(args: argparse.Namespace) -> int:
    """`--replicas`: jobs per minute by replica count (see `h3serve.tools.bench.throughput`)."""
    from h3serve.engine.executor import EngineError
    from h3serve.errors import ConfigError
    from h3serve.tools.bench.throughput import ReplicaLayout, measure, summary
    from h3serve.tools.tiny.make_checkpoint import ensure_tiny_checkpoint

    try:
        counts = [int(n) for n in args.replicas.split(",")]
    except ValueError:
        counts = []
    overlaps = [{"on": True, "off": False}.get(word) for word in args.overlap.split(",")]
    if not counts or min(counts) < 1 or min(args.jobs, args.threads, args.rounds) < 1 or None in overlaps:
        print(
            "error: --replicas takes replica counts like 1,2; --overlap takes on, off or on,off; --jobs, "
            "--threads and --rounds must be >= 1",
            file=sys.stderr,
        )
        return EXIT_USAGE
    layouts = [ReplicaLayout(n, overlap) for n in counts for overlap in overlaps]
    steps = args.steps or 3
    model = Path(args.model) if args.model else ensure_tiny_checkpoint(args.preset or "tiny")
    try:
        results = measure(
            model, layouts, args.jobs, steps, args.threads, args.rounds, lambda line: print(line, file=sys.stderr)
        )
    except (ConfigError, EngineError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(summary(results, steps))
    return 0


def cmd_outputs(args: argparse.Namespace) -> int:
    """`--outputs N`: several outputs as one batch against one after another (`h3serve.tools.bench.outputs`)."""
    from h3serve.errors import ConfigError
    from h3serve.rules import limits
    from h3serve.tools.bench.outputs import measure_outputs, summary
    from h3serve.tools.tiny.make_checkpoint import ensure_tiny_checkpoint

    if not 2 <= args.outputs <= limits.MAX_OUTPUTS_PER_PROMPT or min(args.threads, args.rounds) < 1:
        print(f"error: --outputs takes 2 to {limits.MAX_OUTPUTS_PER_PROMPT}; --threads and --rounds must be >= 1",
              file=sys.stderr)
        return EXIT_USAGE
    steps = args.steps or 3
    model = Path(args.model) if args.model else ensure_tiny_checkpoint(args.preset or "tiny")
    try:
        results, device = measure_outputs(model, args.outputs, steps, args.threads, args.rounds,
                                          lambda line: print(line, file=sys.stderr))
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(summary(results, steps, device))
    return 0


def cmd_dit_forward(args: argparse.Namespace) -> int:
    """`--dit-forward`: one DiT forward, variants against the reference (see `h3serve.tools.bench.dit_forward`)."""
    import json
    from dataclasses import asdict

    from h3serve.accel.attention import AttentionBackendError
    from h3serve.checkpoint.resolver import CheckpointError
    from h3serve.errors import ConfigError
    from h3serve.model.transformer import H3TransformerConfig
    from h3serve.rank.device_checks import resolve_device, resolve_dtype
    from h3serve.tools.bench.dit_forward import MODES, DitBenchSpec, run_dit_bench, summary
    from h3serve.tools.bench.matrix import MatrixError, load_matrix
    from h3serve.tools.tiny.make_checkpoint import ensure_tiny_checkpoint

    modes = tuple(filter(None, args.dit_modes.split(",")))
    try:
        if args.dit_layers is not None and (args.model or args.preset):
            raise MatrixError("--dit-layers (random weights at the released width) excludes --model and --preset")
        if args.dit_layers is not None and args.dit_layers < 1 or args.text_rows < 1:
            raise MatrixError("--dit-layers and --text-rows must be >= 1")
        if not modes or set(modes) - set(MODES):
            raise MatrixError(f"--dit-modes: choose from {', '.join(MODES)}, got {args.dit_modes!r}")
        matrix = load_matrix(
            args.matrix,
            {
                k: getattr(args, k)
                for k in ("model", "preset", "shapes", "engines", "seed", "warmup", "runs", "profile", "gemm_seconds")
            },
        )
        if not matrix.shapes or len(matrix.engines) != 1:
            raise MatrixError(
                "--dit-forward needs one --shape WxHxFRAMES and at most one --engine (device, dtype, "
                "threads, quantization)"
            )
        engine = matrix.engines[0].config(Path("."))
        device = resolve_device(engine)
        if engine.threads:
            import torch

            torch.set_num_threads(engine.threads)
        model = None
        if args.dit_layers is None:
            model = Path(matrix.model) if matrix.model else ensure_tiny_checkpoint(matrix.preset)
        shape = matrix.shapes[0]
        spec = DitBenchSpec(
            width=shape.width,
            height=shape.height,
            num_frames=shape.num_frames,
            text_rows=args.text_rows,
            device=device,
            dtype=resolve_dtype(engine, device),
            model=model,
            random_config=None if model else H3TransformerConfig(num_layers=args.dit_layers),
            modes=modes,
            backends=tuple(args.attention_backends or ("TORCH_SDPA",)),
            warmup=matrix.warmup,
            runs=matrix.runs,
            profile=matrix.profile,
            seed=matrix.seed,
            gemm_seconds=matrix.gemm_seconds,
            quantization=engine.quantization,
        )
        result = run_dit_bench(spec, lambda line: print(line, file=sys.stderr))
    except (MatrixError, ConfigError, CheckpointError, AttentionBackendError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    text = summary(result)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dit_forward.md").write_text(f"Command: `{command_line(args)}`\n\n{text}", encoding="utf-8")
        record = {
            "command": command_line(args),
            "flops": result.flops,
            "gemm_peak_flops": result.gemm_peak_flops,
            "shape": asdict(result.shape),
            "variants": [asdict(v) for v in result.variants],
        }
        (out / "dit_forward.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    print(text)
    return 0


def cmd_realtime(args: argparse.Namespace) -> int:
    """`--realtime`: real-time sessions' latency (see `h3serve.tools.bench.realtime_latency`)."""
    import json
    from dataclasses import asdict, replace

    from h3serve.config_checks import check_config
    from h3serve.engine.executor import EngineError
    from h3serve.engine.realtime_stream import RealtimeSpec
    from h3serve.errors import ConfigError, RequestError
    from h3serve.rank.device_checks import resolve_device
    from h3serve.tools.bench.matrix import MatrixError, load_matrix
    from h3serve.tools.bench.realtime_latency import measure_realtime, summary
    from h3serve.tools.tiny.make_adapter import make_tiny_adapter
    from h3serve.tools.tiny.make_checkpoint import ensure_tiny_checkpoint

    keys = ("model", "preset", "shapes", "engines", "seed", "warmup", "runs", "prompt")
    try:
        matrix = load_matrix(args.matrix, {k: getattr(args, k) for k in keys})
        if len(matrix.shapes) > 1 or len(matrix.engines) != 1:
            raise MatrixError("--realtime takes one --shape WxHxFRAMES and at most one --engine")
        if matrix.model and not args.realtime_lora:
            raise MatrixError("--realtime with --model needs --realtime-lora DIR (the streaming LoRA)")
        model = Path(matrix.model) if matrix.model else ensure_tiny_checkpoint(matrix.preset)
        with tempfile.TemporaryDirectory(prefix="h3serve-bench-lora-") as scratch:
            lora = args.realtime_lora or make_tiny_adapter(Path(scratch) / "taomate", "taomate", matrix.preset)
            config = matrix.engines[0].config(model)
            config = replace(config, realtime_lora=str(lora),
                             task_type=config.task_type if "task_type" in matrix.engines[0].options else "fl2va")
            shape = matrix.shapes[0] if matrix.shapes else None
            width, height, frames = (shape.width, shape.height, shape.num_frames) if shape else (64, 64, 243)
            spec = RealtimeSpec(matrix.prompt, width, height, matrix.seed, frames)
            sessions = measure_realtime(check_config(config), spec, matrix.runs, matrix.warmup,
                                           lambda line: print(line, file=sys.stderr))
        device = str(resolve_device(config))
    except (MatrixError, ConfigError, RequestError, EngineError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    text = summary(sessions, spec, device)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "realtime.md").write_text(f"Command: `{command_line(args)}`\n\n{text}\n", encoding="utf-8")
        record = {"command": command_line(args), "device": device, "spec": asdict(spec),
                  "sessions": [[asdict(c) for c in s.chunks] for s in sessions]}
        (out / "realtime.json").write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
    print(text)
    return 0


def cmd_fp8_block(args: argparse.Namespace) -> int:
    """`--fp8-block`: one block's FP8 error (see `h3serve.tools.bench.fp8_block`)."""
    from h3serve.model.transformer import H3TransformerConfig
    from h3serve.tools.bench.fp8_block import block_errors, summary
    from h3serve.tools.tiny.make_checkpoint import PRESETS

    preset = args.preset or "cpu-bench"
    if preset not in PRESETS or args.block_rows < 1:
        print(f"error: --preset: choose from {', '.join(PRESETS)}; --block-rows must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    cfg = H3TransformerConfig.from_dict(dict(PRESETS[preset].transformer))
    print(summary(cfg, args.block_rows, block_errors(cfg, args.block_rows, args.seed or 0)))
    return 0


def cmd_gpu_acceptance(args: argparse.Namespace) -> int:
    """`--gpu-acceptance`: every GPU row, budgeted (see `h3serve.tools.bench.acceptance`). Exit 0 when no row
    failed (skipped rows do not fail it), 1 otherwise; the JSON and the table are written either way."""
    import json

    from h3serve.entrypoints.plan import plan_from_argv
    from h3serve.tools.bench import acceptance

    budget = acceptance.GLOBAL_BUDGET_S if args.budget_s is None else args.budget_s
    if budget <= 0:
        print("error: --budget-s must be > 0", file=sys.stderr)
        return EXIT_USAGE
    cuda, name = acceptance.device()
    ctx = acceptance.AcceptanceContext(cuda, name, Path(args.out) if args.out else _default_out(), budget,
                             tuple(args.selftest_only), log=lambda line: print(line, file=sys.stderr),
                                       plan_from_argv=plan_from_argv)
    record = acceptance.run(ctx)
    text = acceptance.table(record)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
    if args.table:
        Path(args.table).write_text(text, encoding="utf-8")
    print(text)
    return 0 if record["verdict"].startswith("OK") else 1


def cmd_full_depth(args: argparse.Namespace) -> int:
    """`--full-depth`: the released DiT at full depth on one GPU (see `h3serve.tools.bench.full_depth`)."""
    from h3serve.entrypoints.plan import plan_from_argv
    from h3serve.tools.bench.full_depth import FullDepthSpec, run_full_depth
    from h3serve.tools.bench.matrix import MatrixError, Shape

    if not args.model or not args.out or len(args.shapes or []) > 1:
        print("error: --full-depth needs --model (the gpu-accept checkpoint), --out, and at most one --shape",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        shape = Shape.parse(args.shapes[0]) if args.shapes else Shape(1344, 768, 124)
        spec = FullDepthSpec(Path(args.model), shape.width, shape.height, shape.num_frames, args.seed or 0,
                             args.gemm_seconds or 1.0, Path(args.out))
        result = run_full_depth(spec, plan_from_argv, lambda line: print(line, file=sys.stderr))
    except (MatrixError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"full depth: {len(result.forwards_s)} forwards {', '.join(f'{s:.2f}' for s in result.forwards_s)} s, "
          f"MFU {result.mfu:.1%}; whole request {result.e2e_s:.2f} s, outside the forwards "
          f"{result.outside_forwards_s:.2f} s; sizes {result.sizes}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.gpu_acceptance:
        return cmd_gpu_acceptance(args)
    if args.full_depth:
        return cmd_full_depth(args)
    if args.replicas:
        return cmd_throughput(args)
    if args.outputs is not None:
        return cmd_outputs(args)
    if args.realtime:
        return cmd_realtime(args)
    if args.fp8_block:
        return cmd_fp8_block(args)
    if args.dit_forward:
        return cmd_dit_forward(args)
    from h3serve.checkpoint.resolver import CheckpointError
    from h3serve.errors import ConfigError
    from h3serve.media.media_inputs import MediaError
    from h3serve.rules.validate import RequestError
    from h3serve.tools.bench.matrix import MatrixError, load_matrix
    from h3serve.tools.bench.matrix_run import run_bench
    from h3serve.tools.bench.side_process import BenchError

    overrides = {
        k: getattr(args, k)
        for k in (
            "model",
            "preset",
            "tasks",
            "shapes",
            "engines",
            "steps",
            "seed",
            "prompt",
            "warmup",
            "runs",
            "peer",
            "profile",
            "reference",
            "gemm_seconds",
            "prompt_cache",
        )
    }
    try:
        matrix = load_matrix(args.matrix, overrides)
        out = Path(args.out) if args.out else _default_out()
        result = run_bench(
            matrix,
            out,
            command=command_line(args),
            keep_raw=args.keep_raw,
            log=lambda line: print(line, file=sys.stderr),
        )
    except (MatrixError, ConfigError, RequestError, MediaError, CheckpointError, BenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"records: {out / 'runs.jsonl'}", file=sys.stderr)
    print(result.summary_path)
    return 0
