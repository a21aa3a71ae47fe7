"""The selftest's checks in run order, and running them (torch): `h3serve selftest` imports this only when it runs."""

from __future__ import annotations

import argparse

from h3serve.tools.selftest.core import Check, Context, Outcome, run_check


def checks(ctx: Context) -> list[tuple[str, Check]]:
    """Every check, in run order (cheap and telling first)."""
    from h3serve.accel.attention import BACKENDS
    from h3serve.tools.selftest import model_checks, parallel_checks, system_checks

    out: list[tuple[str, Check]] = [("environment", system_checks.environment),
                                    ("numerics.block_dtype", model_checks.block_dtype)]
    out += [(f"numerics.attention.{name}", model_checks.attention_backend(name)) for name in BACKENDS]
    out += [("numerics.row_chunks", model_checks.row_chunks), ("numerics.compiled", model_checks.compiled),
            ("memory.offload_paths", model_checks.memory_paths),
            ("multi_gpu.collectives", parallel_checks.collectives), ("multi_gpu.tp2", parallel_checks.tensor_parallel),
            ("multi_gpu.ulysses2", parallel_checks.ulysses), ("throughput", model_checks.throughput),
            ("end_to_end", system_checks.end_to_end),
            ("end_to_end.continuation", system_checks.end_to_end_continuation)]
    return out


def run(args: argparse.Namespace) -> list[Outcome]:
    from h3serve.rank.device_checks import check_engine
    from h3serve.tools.cli_util import model_dir
    from h3serve.tools.engine_args import engine_config_from_args

    model = model_dir(args.model)  # the shipped demo checkpoint by default: end_to_end checks what it shows
    config = engine_config_from_args(args, model)
    setup = check_engine(config)
    ctx = Context(
        device=setup.device, dtype=setup.dtype, attention=setup.attention,
        compile=not config.enforce_eager, model=model, engine_config=config,
        budget_s=args.budget_s,
    )
    ctx.shared["args"] = args  # the planner's verdict reads the same engine flags
    chosen = [(n, c) for n, c in checks(ctx) if not args.only or any(n.startswith(p) for p in args.only)]
    return [run_check(name, check, ctx) for name, check in chosen]
