"""Measurements taken inside a bench worker: GEMM peak, sampled host RSS, the environment fingerprint."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_peak(device: torch.device, dtype: torch.dtype, budget_s: float = 3.0) -> dict[str, float]:
    """Best square-GEMM FLOP/s of this process (its threads, device and dtype) within about `budget_s`.

    Through `F.linear`, the path every DiT projection takes (MKL for fp32, oneDNN for bf16 on CPU). n = 2048 on
    CPU (the fp32 ceiling is flat from 1024 to 4096 there), 8192 on GPU. One untimed warm-up, at least 3 reps.
    """
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    F.linear(a, b)
    sync(device)
    best, reps, deadline = float("inf"), 0, time.perf_counter() + budget_s
    while reps < 3 or (time.perf_counter() < deadline and reps < 50):
        start = time.perf_counter()
        F.linear(a, b)
        sync(device)
        best = min(best, time.perf_counter() - start)
        reps += 1
    return {"n": n, "reps": reps, "flops_per_s": 2.0 * n**3 / best}


def cpu_seconds() -> float:
    """User + system CPU time of this process and its live descendants so far.

    On a shared machine this is far steadier than wall time: it counts the work done, not the waiting.
    """
    total = 0.0
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    """Versions, CPU, GPU and thread settings of this process."""
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in ("h3serve", "torch", "diffusers", "transformers", "numpy", "av")},
        "git_commit": _git_commit(),
        "cpu": {
            "model": _cpu_model(),
            "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        },
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "device": str(device),
        "gpu": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = {
            "name": props.name,
            "count": torch.cuda.device_count(),
            "memory_gb": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
        }
    return env
