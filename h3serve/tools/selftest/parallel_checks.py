"""Multi-GPU checks. One session of fresh ranks (h3serve.parallel.launch: NCCL, one per GPU, on every visible GPU
of an even count; two gloo processes of one thread on CPU) runs, on every rank:
  - the collectives of TP, Ulysses and Ring at the sizes one block issues for the throughput request, checked and
    timed (h3serve.tools.selftest.collectives);
  - the few-block DiT (random weights, the numerics shape) on one rank, then under TP2 and under Ulysses-2 built
    by the engine's own code (`RankParallel`: groups, shard-shaped modules, sequence-parallel hooks) over the same
    weights and inputs; the outputs are compared with the one-rank output.
The three checks read the one session.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from h3serve.accel import attention
from h3serve.loading.tensors import materialize
from h3serve.model.transformer import H3Transformer, H3TransformerConfig, RotaryEmbedding3D
from h3serve.offload.activations import RequestShape
from h3serve.parallel.degrees import ParallelDegrees
from h3serve.parallel.launch import RankFailure, run_on_ranks
from h3serve.parallel.setup import RankParallel, parameter_bytes
from h3serve.parallel.tensor_parallel import TensorParallel
from h3serve.tools.bench.dit_forward import DitBenchSpec, _ours, forward_inputs, load_weights
from h3serve.tools.selftest.collectives import USES, measure, message_bytes
from h3serve.tools.selftest.core import CheckFailed, SelftestContext, Skip
from h3serve.tools.selftest.model_checks import rel_error, run_forward

# Relative RMS error against one rank. fp32 (CPU): only the order of the sums differs (TP's split GEMMs, GEMMs
# over fewer rows), about 1e-7. bf16 (GPU): TP2 rounds each partial product to bf16 before the fp32 sum, and
# both sides round every block's output; about the bf16 rounding of three blocks (their bf16-against-fp32 error
# sits near 1e-2). A shard that drops a head, or a collective that returns wrong values, is far outside both.
PARITY_BOUND = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
TEXT_ROWS = 256  # the throughput request's text rows: the collectives are sized for that request
SESSION_S = 240.0  # process start, NCCL set-up, weights and forwards; a hang fails the checks instead
LAYOUTS = {"tp2": ParallelDegrees(tensor_parallel=2), "ulysses2": ParallelDegrees(ulysses=2)}


@dataclass(frozen=True)
class SessionSpec:
    config: H3TransformerConfig
    dtype: torch.dtype
    numerics_shape: tuple[int, int, int]  # (width, height, frames) of the parity forwards
    rows: int  # packed rows the collectives are sized for
    attention: dict[str, str]  # role -> backend of the engine flags
    cuda: bool
    calls: int = 5  # timed calls per collective


def _sharded(
    cfg: H3TransformerConfig,
    weights: dict[str, torch.Tensor],
    tp: TensorParallel | None,
    dtype: torch.dtype,
    device: torch.device,
) -> H3Transformer:
    """The DiT over `weights` as a rank of `tp` holds it (shard-shaped modules, its slices), Q/K/V fused."""
    if tp is None:
        return _ours(cfg, dict(weights), device)
    with torch.device("meta"):
        model = H3Transformer(cfg)
    tp.shard_module(model)
    tensors = ((name, tp.cut(name, full)) for name, full in weights.items())
    materialize(model, tensors, dtype, device, H3Transformer.keep_in_fp32_modules)
    model.rope = RotaryEmbedding3D(cfg.rope_freq_dim, cfg.rope_theta).to(device)
    model.fuse_projections()
    return model.eval()


def rank_session(rank: int, world: int, spec: SessionSpec) -> dict:
    """What every rank of the session runs (after joining the group): collectives, then the parity forwards."""
    device = torch.device("cuda", torch.cuda.current_device()) if spec.cuda else torch.device("cpu")
    sizes = message_bytes(spec.config, spec.rows, world, spec.dtype)
    out: dict = {"collectives": measure(rank, world, sizes, spec.dtype, device, spec.calls)}
    if spec.cuda:
        torch.cuda.empty_cache()  # the collectives' buffers
    bench = DitBenchSpec(*spec.numerics_shape, 64, device, spec.dtype, None, random_config=spec.config)
    cfg, weights = load_weights(bench)  # seeded: the same weights on every rank
    x = forward_inputs(cfg, bench)
    one_rank = _sharded(cfg, weights, None, spec.dtype, device)
    attention.install(one_rank, spec.attention)
    reference = run_forward(one_rank, x)
    whole_bytes = parameter_bytes(one_rank)
    del one_rank
    for name, degrees in LAYOUTS.items():
        parallel = RankParallel.build(replace(degrees, world_size=world), rank)  # extra pairs run as replicas
        model = _sharded(cfg, weights, parallel.dit_tp, spec.dtype, device)
        attention.install(model, spec.attention)
        parallel.install_dit(model, attention.BACKENDS[spec.attention["self"]])
        got = run_forward(model, x)
        sequence = parallel.sequence
        out[name] = {
            "video": rel_error(got[0], reference[0]),
            "audio": rel_error(got[1], reference[1]),
            # what the layout changed on this rank: its share of the parameters, its rows of the packed sequence
            "params": parameter_bytes(model) / whole_bytes,
            "rows": (sequence.chunk, sequence.seq_len) if sequence is not None else (x.shape.seq_len,) * 2,
        }
        del model
    return out


def _world(ctx: SelftestContext) -> int:
    if not ctx.cuda:
        return 2  # two gloo processes: the same code paths at the reduced width, in seconds
    count = torch.cuda.device_count()
    if count < 2:
        raise Skip(f"{count} GPU visible: the multi-GPU checks need two or more")
    return count - count % 2  # TP2 and Ulysses-2 pair the ranks up


def _session(ctx: SelftestContext) -> tuple[int, list[dict]]:
    """The session's per-rank results (run once for the three checks); CheckFailed with a rank's error."""
    world = _world(ctx)
    if "multi_gpu" not in ctx.shared:
        width, height, frames = ctx.shape()
        rows = RequestShape(width, height, frames, prompt_tokens=TEXT_ROWS).seq_len
        spec = SessionSpec(ctx.dit, ctx.dtype, ctx.numerics_shape(), rows, dict(ctx.attention), ctx.cuda)
        if ctx.cuda:
            torch.cuda.empty_cache()  # rank 0 shares GPU 0 with this process
        try:
            got: list[dict] | RankFailure = run_on_ranks(
                world,
                rank_session,
                spec,
                cuda=ctx.cuda,
                threads=None if ctx.cuda else 1,
                timeout_s=min(SESSION_S, max(30.0, ctx.left_s())),
                collective_s=120.0,
            )
        except RankFailure as e:
            got = e
        ctx.shared["multi_gpu"] = got
    got = ctx.shared["multi_gpu"]
    if isinstance(got, RankFailure):
        raise CheckFailed(f"the {world}-rank session failed ({got.last_line}); run with one GPU's flags to isolate it")
    return world, got


def collectives(ctx: SelftestContext) -> tuple[str, dict]:
    """TP's all-reduce, Ulysses' all-to-all, Ring's exchange and the sequence gather: right values, bandwidth."""
    world, ranks = _session(ctx)
    backend = "NCCL" if ctx.cuda else "gloo"
    for rank, got in enumerate(ranks):
        wrong = [op for op, m in got["collectives"].items() if not m["ok"]]
        if wrong:
            raise CheckFailed(
                f"{backend} {wrong[0]} returned wrong values on rank {rank} of {world}: check the "
                f"{backend} install and its transport (NCCL_P2P_DISABLE=1, NCCL_IB_DISABLE=1 narrow it down)"
            )
    data = {}
    for op in USES:  # the slowest rank's figure
        slowest = min((got["collectives"][op] for got in ranks), key=lambda m: m["busbw_gbps"])
        data[op] = slowest | {"use": USES[op]}
    where = f"{world} GPUs, NCCL" if ctx.cuda else f"{world} CPU ranks, gloo"
    parts = [f"{op} {m['bytes'] / 2**20:.3g} MiB {m['busbw_gbps']:.3g} GB/s" for op, m in data.items()]
    return f"{where}, bus bandwidth at one block's sizes: {', '.join(parts)}", data


def _applied(name: str, got: dict) -> str | None:
    """What shows the layout ran on a rank (a shard of the weights, a chunk of the rows); None if it did not."""
    chunk, rows = got["rows"]
    if name == "tp2":
        return f"each rank holds {got['params']:.0%} of the weights" if got["params"] < 0.75 else None
    return f"each rank runs {chunk} of {rows} rows through the blocks" if chunk < rows else None


def _parity(name: str, label: str, path: str):
    def check(ctx: SelftestContext) -> tuple[str, dict]:
        world, ranks = _session(ctx)
        applied = [_applied(name, got[name]) for got in ranks]
        if None in applied:
            raise CheckFailed(f"{label} was not applied on rank {applied.index(None)}: the parallel set-up is wrong")
        video = max(got[name]["video"] for got in ranks)
        audio = max(got[name]["audio"] for got in ranks)
        bound = PARITY_BOUND[ctx.dtype]
        dtype = str(ctx.dtype).split(".")[-1]
        figure = (
            f"{label} against one rank ({world // 2} pair(s), {dtype}; {applied[0]}): rel. RMS error "
            f"video {video:.1e}, audio {audio:.1e} (bound {bound:.0e})"
        )
        if max(video, audio) > bound:
            raise CheckFailed(f"{figure}: the {label} output differs from one rank; {path} is wrong here")
        return figure, {"video": video, "audio": audio, "bound": bound, "applied": applied[0]}

    check.__doc__ = f"The few-block DiT under {label} against one rank, same weights and inputs."
    return check


tensor_parallel = _parity("tp2", "TP2", "tensor parallelism (its shards or their all-reduce)")
ulysses = _parity("ulysses2", "Ulysses-2", "sequence parallelism (its all-to-all or the row gather)")
