"""A `PlacementPlan` as text (the start-up log and `h3serve plan`) and as JSON (`h3serve plan --json`, bench)."""

from __future__ import annotations

from h3serve.offload.lora_bytes import ADAPTERS
from h3serve.offload.measured_engine import UNMODELLED, UNMODELLED_PROFILES
from h3serve.offload.overhead import TERMS
from h3serve.offload.placement_plan import ADALN_MEMO, COMPONENTS, PROMPT_CACHE, GiB, PlacementPlan, RankPlan
from h3serve.offload.realtime_kv import REALTIME_KV

STAGE_LABELS = {
    "text_encode": "text enc",
    "vae_encode": "vae enc",
    "denoise": "denoise",
    "video_decode": "video dec",
    "audio_decode": "audio dec",
}


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _rank_key(r: RankPlan) -> tuple:
    return (r.stages, tuple(sorted(r.host_bytes.items())))


def _groups(plan: PlacementPlan) -> list[list[RankPlan]]:
    """Consecutive ranks with identical plans, printed once."""
    groups: list[list[RankPlan]] = []
    for r in plan.ranks:
        if groups and _rank_key(groups[-1][0]) == _rank_key(r):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _table(r: RankPlan) -> list[str]:
    stages = r.stages
    width = 11
    header = f"  {'GiB on the device':<28}" + "".join(f"{STAGE_LABELS[s.stage]:>{width}}" for s in stages)
    header += f"{'host pinned':>{width + 2}}"
    lines = [header]

    def row(label: str, values: list[int], host: int | None = None) -> str:
        text = f"  {label:<28}" + "".join(f"{gib(v):>{width}}" for v in values)
        return text + (f"{gib(host):>{width + 2}}" if host is not None else "")

    for c in (*COMPONENTS, ADAPTERS, REALTIME_KV):
        weights = [s.weights.get(c, 0) for s in stages]
        buffers = [s.stream_buffers.get(c, 0) for s in stages]
        host = r.host_bytes.get(c, 0)
        if any(weights) or host:
            lines.append(row(f"{c} weights", weights, host or None))  # blank: never leaves the device
        if any(buffers):
            lines.append(row(f"{c} stream buffers", buffers))
    if any(s.modulations for s in stages):
        lines.append(row("AdaLN modulations", [s.modulations for s in stages]))
    lines.append(row("activations (estimate)", [s.activations for s in stages]))
    for key, label in ((ADALN_MEMO, "AdaLN memo store"), (PROMPT_CACHE, "prompt cache")):  # host memory only
        if key in r.host_bytes:
            lines.append(f"  {label:<28}{'':>{width * len(stages)}}{gib(r.host_bytes[key]):>{width + 2}}")
    lines.append(row("tensors", [s.tensor_bytes for s in stages]))
    if any(s.overhead for s in stages):  # apart from the tensors, which the allocator's peak is checked against
        lines.append("  runtime overhead (not tensors; h3serve.offload.overhead)")
        communicators = len(r.communicators)
        for term in TERMS:
            values = [s.overhead.get(term, 0) for s in stages]
            if any(values):
                label = f"nccl ({communicators} communicators)" if term == "nccl" else term
                lines.append(row(f"  {label}", values))
    lines.append(row("total (as nvidia-smi)", [s.device_bytes for s in stages], r.total_host_bytes))
    return lines


def verdict(plan: PlacementPlan) -> str:
    peak = plan.peak_device_bytes
    if plan.device_memory is None:
        return f"peak {gib(peak)} GiB per device (no --device-memory given: no verdict)"
    budget = f"{gib(plan.device_memory)} GiB device with {gib(plan.headroom)} GiB headroom"
    if plan.fits:
        spare = plan.device_memory - plan.headroom - peak
        return f"fits: peak {gib(peak)} GiB on a {budget} ({gib(spare)} GiB spare)"
    return f"does not fit by {gib(plan.shortfall_bytes)} GiB: peak {gib(peak)} GiB on a {budget}"


def unmodelled_bytes(plan: PlacementPlan) -> int:
    """How far above the planned peak a run may still go: the largest excess of a published measurement over its
    plan (h3serve.offload.measured_engine.UNMODELLED), applied to this plan's peak."""
    return int(plan.peak_device_bytes * UNMODELLED[1])


def unmodelled(plan: PlacementPlan) -> str:
    low, high = UNMODELLED
    return (
        f"unmodelled: {UNMODELLED_PROFILES} published peaks measured {100 * low:+.1f} ... {100 * high:+.1f}% of their "
        f"plans (docs/memory.md): up to {gib(unmodelled_bytes(plan))} GiB above this peak (allocator fragmentation, "
        "kernel workspaces, engine builds)"
    )


def format_plan(plan: PlacementPlan, title: str | None = None) -> str:
    """Per rank (identical ranks once) and per stage: the device bytes by component, host bytes, peak, verdict."""
    lines = [title] if title else []
    lines += [f"  {note}" for note in plan.notes]
    if plan.resident_layers:
        lines.append(f"  resident DiT blocks during denoise: {plan.resident_layers}")
    if plan.denoise_chunk_rows:
        lines.append(f"  denoise working set in chunks of {plan.denoise_chunk_rows} rows (--denoise-chunk-rows)")
    for group in _groups(plan):
        first, last = group[0].rank, group[-1].rank
        name = f"rank {first}" if first == last else f"ranks {first}-{last} (each)"
        r = group[0]
        lines.append(f"{name}: peak {gib(r.peak_device_bytes)} GiB in {r.peak_stage}")
        lines += _table(r)
    lines.append(verdict(plan))
    lines.append(unmodelled(plan))
    return "\n".join(lines)


def plan_json(plan: PlacementPlan) -> dict:
    """Per rank: peak_device_bytes, peak_stage, host_bytes and per stage its component bytes; plus `fits` and the
    margin the planner cannot model (`unmodelled_margin`)."""
    return {
        "fits": plan.fits,
        "peak_device_bytes": plan.peak_device_bytes,
        "peak_tensor_bytes": plan.peak_tensor_bytes,
        "device_memory": plan.device_memory,
        "headroom": plan.headroom,
        "shortfall_bytes": plan.shortfall_bytes,
        "resident_layers": plan.resident_layers,
        "denoise_chunk_rows": plan.denoise_chunk_rows,
        "unmodelled_margin": {
            "low": UNMODELLED[0],
            "high": UNMODELLED[1],
            "profiles": UNMODELLED_PROFILES,
            "bytes_above_peak": unmodelled_bytes(plan),
        },
        "notes": list(plan.notes),
        "ranks": [
            {
                "rank": r.rank,
                "peak_device_bytes": r.peak_device_bytes,
                "peak_tensor_bytes": r.peak_tensor_bytes,
                "peak_stage": r.peak_stage,
                "communicators": list(r.communicators),
                "host_bytes": dict(r.host_bytes),
                "stages": {
                    s.stage: {
                        "weights": dict(s.weights),
                        "stream_buffers": dict(s.stream_buffers),
                        "activations": s.activations,
                        "modulations": s.modulations,
                        "tensor_bytes": s.tensor_bytes,
                        "overhead": dict(s.overhead),
                        "device_bytes": s.device_bytes,
                    }
                    for s in r.stages
                },
            }
            for r in plan.ranks
        ],
    }
