"""The engine flags' start-up checks that need torch, run by each rank before it reads a weight (and by the CLI
before it starts any): which device `auto` is, whether the GPUs and kernels asked for are there. The parent checks
everything else without torch (`h3serve.config_checks.check_config`); a refusal here is the same `ConfigError`, and
the executor hands it to the parent as one (`Fatal.config_error`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from h3serve.accel.attention import AttentionBackendError, resolve_roles
from h3serve.accel.cache_profile import backend_refusal
from h3serve.accel.quant_checks import check_quantization
from h3serve.config.engine_config import EngineConfig
from h3serve.config_checks import device_notices
from h3serve.errors import ConfigError
from h3serve.parallel.rendezvous import nodes_from_env


@dataclass(frozen=True)
class RankDevice:
    """What the checks resolved: the device, the compute dtype and each DiT role's attention backend."""

    device: torch.device
    dtype: torch.dtype
    attention: dict[str, str]


def resolve_device(config: EngineConfig) -> torch.device:
    """--device as a torch device (`auto`: CUDA when a GPU is visible)."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:  # `validate` checked the spelling; a config built without it (bench, tools) is checked here
        device = torch.device(config.device)
    except RuntimeError:
        raise ConfigError(f"--device: unknown device {config.device!r}; choose from: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device: CUDA was requested but no GPU is visible; use --device cpu")
    return device


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """--dtype as a torch dtype (`auto`: bfloat16 on GPU, float32 on CPU)."""
    name = config.dtype_name()
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def attention_roles(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """The attention backend of each DiT role, checked against this device; `ConfigError` lists the usable."""
    try:
        return resolve_roles(config.attention_backend, config.attention_per_role, device, config.ring_degree > 1, dtype)
    except AttentionBackendError as e:
        raise ConfigError(str(e)) from None


def check_engine(config: EngineConfig) -> RankDevice:
    """Every check of the flags that needs torch; `ConfigError` with the fix in its message."""
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    roles = attention_roles(config, device, dtype)
    refusal = backend_refusal(config, device.type)  # `auto` resolved: the device's own reasons too
    if refusal:
        raise ConfigError(f"--cache-backend {config.cache_backend} is not available with {refusal}")
    if config.quantization is not None:
        check_quantization(config.quantization, config.model, config.dits, device)
    if device.type == "cuda":
        devices = config.world_size * config.data_parallel_size
        per_node, visible = devices // nodes_from_env(), torch.cuda.device_count()
        if per_node > visible:
            raise ConfigError(
                f"--num-gpus {devices} needs {per_node} GPUs on this node, {visible} are visible; "
                f"use --num-gpus {visible} (or run across nodes, see h3serve.parallel.rendezvous)"
            )
    return RankDevice(device, dtype, roles)


def start_up_notices(config: EngineConfig, device: torch.device) -> list[str]:
    """The device's notices the parent could not print (it prints them itself when --device names the device)."""
    return device_notices(config, device.type) if config.device_type is None else []


def cpu_threads(config: EngineConfig, device: torch.device, cpu_count: int | None = None) -> int:
    """A rank's intra-op threads: --threads, else on CPU with data-parallel replicas an equal share of the cores
    among every rank of every replica; 0 keeps torch's default."""
    if config.threads or config.data_parallel_size == 1 or device.type != "cpu":
        return config.threads
    ranks = config.data_parallel_size * config.world_size
    return max(1, (cpu_count or os.cpu_count() or 1) // ranks)
