"""The selftest's checks in run order, and running them (torch): `h3serve selftest` imports this only when it runs."""

from __future__ import annotations

from h3serve.tools.selftest.core import Check, Outcome, SelftestContext, run_check


def checks(ctx: SelftestContext) -> list[tuple[str, Check]]:
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


def run(ctx: SelftestContext, only: list[str]) -> list[Outcome]:
    """Every check whose name starts with one of `only` (all when empty), in order, within the budget."""
    chosen = [(n, c) for n, c in checks(ctx) if not only or any(n.startswith(p) for p in only)]
    return [run_check(name, check, ctx) for name, check in chosen]
