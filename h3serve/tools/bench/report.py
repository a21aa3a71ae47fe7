"""Bench records -> medians per case and side, peer ratios, a Markdown summary and PNG plots.

Only `measured` runs enter the statistics; warm-up and profiled runs are recorded but never averaged. Beside the
medians, the best (minimum) times and the median of the per-pair ratios are given: on a shared machine other
work only ever adds time, so the minimum is the steadiest estimate, and the two runs of a pair ran back to back.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from h3serve.extras import require
from h3serve.tools.bench.matrix import SIDE, BenchMatrix

STAGES = ("media_load", "vision_encode", "text_encode", "vae_encode", "denoise", "video_decode", "audio_decode", "mux")
FIDELITY = ("psnr_db", "ssim", "pixel_cosine", "mel_cosine", "snr_db")


def _median(values: list[float | None]) -> float | None:
    """Median; None entries are +inf (JSON has no infinity: an identical output's PSNR is stored as null)."""
    if not values:
        return None
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else m


def _forward_per_step(run: dict[str, Any]) -> float | None:
    """One run's DiT forward time per step, its forwards' mean (None when the DiT ran in other processes): with
    `_outside_per_step` it adds up to the run's denoise time per step."""
    dit = run["dit"]
    return sum(dit["forward_s"]) / len(dit["forward_s"]) if dit is not None and dit["forward_s"] else None


def _outside_per_step(run: dict[str, Any]) -> float | None:
    """One run's denoise time per step outside the DiT forwards: solver updates, schedules, per-request set-up."""
    dit = run["dit"]
    if dit is None or not dit["forward_s"]:
        return None
    return (run["stages"]["denoise"] - sum(dit["forward_s"])) / len(dit["forward_s"])


def _side_stats(runs: list[dict[str, Any]], profile: dict[str, Any] | None) -> dict[str, Any]:
    dits = [r["dit"] for r in runs if r["dit"] is not None]
    device = [r["memory"]["peak_device_allocated_mb"] for r in runs if r["memory"]["peak_device_allocated_mb"]]
    fidelity = [r["fidelity"] for r in runs if r["fidelity"] is not None]
    return {
        "runs": len(runs),
        "e2e_client_s": _median([r["e2e_client_s"] for r in runs]),
        "e2e_engine_s": _median([r["e2e_engine_s"] for r in runs]),
        "denoise_per_step_s": _median([r["stages"]["denoise_per_step"] for r in runs]),
        "denoise_per_step_best_s": min(r["stages"]["denoise_per_step"] for r in runs),
        "e2e_client_best_s": min(r["e2e_client_s"] for r in runs),
        "cpu_s": _median([r["cpu_s"] for r in runs]),
        "dit_forward_best_s": min((t for d in dits for t in d["forward_s"]), default=None),
        # A denoise step = one DiT forward + the step's work outside it: both, side by side with the step.
        "dit_forward_per_step_s": _median([m for r in runs if (m := _forward_per_step(r)) is not None]),
        "outside_dit_per_step_s": _median([o for r in runs if (o := _outside_per_step(r)) is not None]),
        "stages_s": {s: _median([r["stages"][s] for r in runs]) for s in STAGES if s in runs[0]["stages"]},
        "dit_flops_per_run": dits[0]["flops"] if dits else None,  # every forward + text embedding of one run
        "dit_flops_per_s": _median([d["flops_per_s"] for d in dits]) if dits else None,
        "fraction_of_gemm_peak": _median([d["fraction_of_gemm_peak"] for d in dits]) if dits else None,
        "gemm_peak_flops_per_s": runs[0]["gemm_peak"]["flops_per_s"],
        "peak_rss_mb": max(r["memory"]["peak_rss_sampled_mb"] for r in runs),
        "peak_device_mb": max(device) if device else None,
        # The memory planner's prediction for the same request (h3serve only; the peer has no plan).
        "planned_peak_device_mb": max((r["memory"].get("planned_peak_device_mb") or 0.0 for r in runs), default=0.0)
        or None,
        # A streamed run has no float arrays: its MP4's bytes stand for its output.
        "distinct_outputs": len({r["output"]["raw_sha256"] or r["output"]["mp4_sha256"] for r in runs}),
        "fidelity": {
            "reference": fidelity[0]["reference"],
            **{k: _median([f[k] for f in fidelity]) for k in FIDELITY},
            "video_max_abs_diff": max(f["video_max_abs_diff"] for f in fidelity),
            "audio_max_abs_diff": max(f["audio_max_abs_diff"] for f in fidelity),
        } if fidelity else None,
        "profile": profile,
        "timeline": runs[-1].get("timeline") or [],  # the last run's stage spans, in seconds from its start
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _paired_ratios(records: list[dict[str, Any]], case: str, peer: str) -> dict[str, float | None]:
    """Median over run indices of h3serve_i / peer_i (the two runs of index i ran back to back)."""
    runs = {(r["side"], r["index"]): r for r in records if r["case"] == case and r["phase"] == "measured"}
    pairs = [(a, runs[(peer, i)]) for (side, i), a in runs.items() if side == SIDE and (peer, i) in runs]
    return {
        "paired_denoise_per_step_s": _median(
            [a["stages"]["denoise_per_step"] / b["stages"]["denoise_per_step"] for a, b in pairs]
        ),
        "paired_e2e_client_s": _median([a["e2e_client_s"] / b["e2e_client_s"] for a, b in pairs]),
        # The same pairs' DiT forwards alone: where the step ratio should follow.
        "paired_dit_forward_per_step_s": _median(
            [fa / fb for a, b in pairs if (fa := _forward_per_step(a)) is not None and (fb := _forward_per_step(b))]
        ),
    }


def summarize(records: list[dict[str, Any]], matrix: BenchMatrix) -> dict[str, Any]:
    cases = []
    for case in dict.fromkeys(r["case"] for r in records):
        sides = {}
        for side in dict.fromkeys(r["side"] for r in records if r["case"] == case):
            mine = [r for r in records if r["case"] == case and r["side"] == side]
            measured = [r for r in mine if r["phase"] == "measured"]
            profile = next((r["profile"] for r in mine if r["phase"] == "profile"), None)
            sides[side] = _side_stats(measured, profile)
        ratios = None
        if matrix.peer and matrix.peer in sides:
            a, b = sides[SIDE], sides[matrix.peer]
            keys = ("denoise_per_step_s", "denoise_per_step_best_s", "dit_forward_best_s", "dit_forward_per_step_s",
                    "e2e_client_s",
                    "e2e_client_best_s", "e2e_engine_s", "cpu_s", "peak_rss_mb", "peak_device_mb")
            ratios = {k: _ratio(a[k], b[k]) for k in keys}
            ratios.update(_paired_ratios(records, case, matrix.peer))
        request = next(r["request"] for r in records if r["case"] == case)
        cases.append({"case": case, "request": request, "sides": sides, "ratios_vs_peer": ratios})
    return {
        "environment": records[0]["environment"] if records else None,
        "matrix": {k: getattr(matrix, k)
                   for k in ("steps", "warmup", "runs", "peer", "reference", "seed", "prompt", "prompt_cache")},
        "cases": cases,
    }


# --------------------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------------------


def _f(value: float | None, fmt: str = ".3f", none: str = "–") -> str:
    return none if value is None else format(value, fmt)


def _environment_line(env: dict[str, Any]) -> str:
    p, cpu, gpu = env["packages"], env["cpu"], env["gpu"]
    where = f"GPU {gpu['name']} x{gpu['count']}" if gpu else f"CPU only ({cpu['capability']})"
    return (
        f"{cpu['model']}, {cpu['usable_cpus']} usable CPUs, {cpu['memory_gb']} GB; {where}; torch threads "
        f"{env['torch_threads']}; python {env['python']}, torch {p['torch']}, diffusers {p['diffusers']}, "
        f"transformers {p['transformers']}; h3serve {env['git_commit'] or p['h3serve']}"
    )


def _case_markdown(case: dict[str, Any]) -> list[str]:
    req = case["request"]
    header = ["side", "runs", "E2E client s (best)", "E2E engine s", "CPU s", "denoise/step s (best)",
              "best DiT forward s",
              *(f"{s} s" for s in STAGES), "DiT GFLOP/s", "of GEMM peak (GFLOP/s)", "peak RSS MB", "peak device MB",
              "planned peak MB", "distinct outputs"]
    lines = [
        f"### {case['case']}",
        "",
        f"{req['task']}, {req['width']}x{req['height']}, {req['num_frames']} frames, "
        f"{req['steps']} steps (denoiser forwards), "
        f"seed {req['seed']}",
        "",
        "| " + " | ".join(header) + " |",
        "|---" * len(header) + "|",
    ]
    for side, s in case["sides"].items():
        stages = " | ".join(_f(s["stages_s"].get(k)) for k in STAGES)
        gflops = None if s["dit_flops_per_s"] is None else s["dit_flops_per_s"] / 1e9
        lines.append(
            f"| {side} | {s['runs']} | {_f(s['e2e_client_s'])} ({_f(s['e2e_client_best_s'])}) | "
            f"{_f(s['e2e_engine_s'])} | {_f(s['cpu_s'], '.1f')} | "
            f"{_f(s['denoise_per_step_s'])} ({_f(s['denoise_per_step_best_s'])}) | {_f(s['dit_forward_best_s'])} | "
            f"{stages} | {_f(gflops, '.1f')} | "
            f"{_f(s['fraction_of_gemm_peak'], '.1%')} (peak {s['gemm_peak_flops_per_s'] / 1e9:.0f}) | "
            f"{s['peak_rss_mb']:.0f} | {_f(s['peak_device_mb'], '.0f')} | "
            f"{_f(s['planned_peak_device_mb'], '.0f')} | {s['distinct_outputs']} |"
        )
    lines += ["", "Timeline of the last measured run (seconds from the request's start; overlapping spans ran beside "
                  "each other):"]
    lines += [f"- {side}: " + ", ".join(f"{name} {start:.2f}-{end:.2f}" for name, start, end in s["timeline"])
              for side, s in case["sides"].items() if s["timeline"]]
    lines += ["", "A denoise step, side by side (medians over runs): step = DiT forward + work outside the DiT"]
    lines += [f"- {side}: {_f(s['denoise_per_step_s'])} s = {_f(s['dit_forward_per_step_s'])} s + "
              f"{_f(s['outside_dit_per_step_s'])} s" for side, s in case["sides"].items()]
    if case["ratios_vs_peer"]:
        r = case["ratios_vs_peer"]
        lines += [
            f"- h3serve / peer, median of paired ratios: denoise step {_f(r['paired_denoise_per_step_s'])}, "
            f"DiT forward {_f(r['paired_dit_forward_per_step_s'])}",
        ]
        lines += [
            "",
            "h3serve / peer (< 1: h3serve is faster or smaller), ratio of medians / of best runs / median of paired "
            f"ratios: denoise step {_f(r['denoise_per_step_s'])} / {_f(r['denoise_per_step_best_s'])} / "
            f"{_f(r['paired_denoise_per_step_s'])}; best single DiT forward {_f(r['dit_forward_best_s'])}; "
            f"E2E client {_f(r['e2e_client_s'])} / "
            f"{_f(r['e2e_client_best_s'])} / {_f(r['paired_e2e_client_s'])}; E2E engine {_f(r['e2e_engine_s'])}; "
            f"CPU seconds {_f(r['cpu_s'])}; peak RSS {_f(r['peak_rss_mb'])}; "
            f"peak device memory {_f(r['peak_device_mb'])}",
        ]
    for side, s in case["sides"].items():
        if fid := s["fidelity"]:
            lines += [
                "",
                f"Fidelity of {side} against {fid['reference']} (medians; max diff over runs): PSNR "
                f"{_f(fid['psnr_db'], '.2f', 'inf')} dB, SSIM {_f(fid['ssim'], '.5f')}, pixel cosine "
                f"{_f(fid['pixel_cosine'], '.6f')}, log-mel cosine {_f(fid['mel_cosine'], '.6f')}, SNR "
                f"{_f(fid['snr_db'], '.2f', 'inf')} dB, max |diff| video {fid['video_max_abs_diff']:.3g} / "
                f"audio {fid['audio_max_abs_diff']:.3g}",
            ]
    for side, s in case["sides"].items():
        if prof := s["profile"]:
            shares = ", ".join(f"{k} {v:.1%}" for k, v in prof["shares"].items())
            lines += [
                "",
                f"Profile of {side} ({prof['time_basis']}, {prof['total_s']:.2f} s): {shares}; trace `{prof['trace']}`",
                "",
                "| op | category | calls | self s | share |",
                "|---|---|---|---|---|",
            ]
            lines += [f"| `{o['name']}` | {o['category']} | {o['calls']} | {o['self_s']:.3f} | {o['share']:.1%} |"
                      for o in prof["top_ops"]]
    return lines + [""]


def render_markdown(summary: dict[str, Any], plots: list[Path], command: str) -> str:
    m = summary["matrix"]
    lines = [
        "# h3serve bench",
        "",
        f"Command: `{command}`" if command else "",
        "",
        f"Environment: {_environment_line(summary['environment'])}" if summary["environment"] else "",
        "",
        f"{m['runs']} measured runs after {m['warmup']} warm-up per side; medians over measured runs"
        + (f"; peer {m['peer']}, alternated ABBA" if m["peer"] else "") + f"; fidelity reference: {m['reference']}"
        + f"; prompt cache {m.get('prompt_cache', 'cold')}.",
        "",
    ]
    for case in summary["cases"]:
        lines += _case_markdown(case)
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------------------


def make_plots(records: list[dict[str, Any]], summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """stages.png (median stage times), step_times.png (per-step time per run, in run order), memory.png, and
    timeline.png (per request: each stage's start and end in its last measured run, so overlap shows)."""
    require("plots", "the bench report's plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(c["case"], side, s) for c in summary["cases"] for side, s in c["sides"].items()]
    if not rows:
        return []
    labels = [f"{case}\n{side}" for case, side, _ in rows]
    paths = []

    fig, ax = plt.subplots(figsize=(8, 1.0 + 0.6 * len(rows)), dpi=80)
    left = [0.0] * len(rows)
    for stage in STAGES:
        widths = [s["stages_s"].get(stage) or 0.0 for _, _, s in rows]
        if any(widths):
            ax.barh(labels, widths, left=left, label=stage)
            left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("seconds (median of measured runs)")
    ax.set_title("Stage durations")
    ax.legend(fontsize=7, loc="lower right")
    ax.tick_params(axis="y", labelsize=7)
    paths.append(_save(fig, out_dir / "stages.png"))

    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=80)
    measured = [r for r in records if r["phase"] == "measured"]
    for key in dict.fromkeys((r["case"], r["side"]) for r in measured):
        runs = [(n, r) for n, r in enumerate(measured) if (r["case"], r["side"]) == key]
        ax.plot([n for n, _ in runs], [r["stages"]["denoise_per_step"] for _, r in runs], "o-", label=" / ".join(key))
    ax.set_xlabel("measured run, in execution order")
    ax.set_ylabel("denoise seconds per step")
    ax.set_title("Per-step time, A/B alternated (grey: host load before the run)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left")
    load = ax.twinx()
    load.plot(range(len(measured)), [r["host_load_1min"][0] for r in measured], ":", color="grey")
    load.set_ylabel("1-min load average", color="grey")
    load.set_ylim(bottom=0)
    paths.append(_save(fig, out_dir / "step_times.png"))

    fig, ax = plt.subplots(figsize=(8, 1.0 + 0.6 * len(rows)), dpi=80)
    ax.barh(labels, [s["peak_rss_mb"] for _, _, s in rows], label="peak host RSS (sampled)")
    device = [s["peak_device_mb"] or 0.0 for _, _, s in rows]
    if any(device):
        ax.barh(labels, device, height=0.4, label="peak device allocated")
    ax.set_xlabel("MB")
    ax.set_title("Peak memory")
    ax.legend(fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
    paths.append(_save(fig, out_dir / "memory.png"))
    timeline = _timeline_plot(records, out_dir / "timeline.png")
    return [*paths, timeline] if timeline else paths


def _timeline_plot(records: list[dict[str, Any]], path: Path) -> Path | None:
    """One panel per request (case and side, its last measured run): a lane per stage, a bar per run of it."""
    import matplotlib.pyplot as plt

    last: dict[tuple[str, str], dict[str, Any]] = {}
    for record in records:
        if record["phase"] == "measured" and record.get("timeline"):
            last[(record["case"], record["side"])] = record
    if not last:
        return None
    fig, axes = plt.subplots(len(last), 1, figsize=(9, 0.6 + 1.5 * len(last)), dpi=80, squeeze=False)
    colours = {stage: f"C{i}" for i, stage in enumerate(STAGES)}
    end = max(span[2] for r in last.values() for span in r["timeline"])
    for ax, ((case, side), record) in zip(axes[:, 0], last.items(), strict=True):
        lanes = list(dict.fromkeys(name for name, _, _ in record["timeline"]))
        for name, start, stop in record["timeline"]:
            ax.barh(lanes.index(name), stop - start, left=start, color=colours.get(name, "grey"), height=0.7)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.02)
        ax.set_title(f"{case} / {side}: E2E engine {record['e2e_engine_s']:.2f} s", fontsize=8)
    axes[-1, 0].set_xlabel("seconds from the request's start (last measured run)")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
