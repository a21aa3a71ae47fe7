"""The rank's start-up check (what only torch can tell about the flags) and what it resolves: the device, the
dtype, the CPU threads of data-parallel replicas, the notices `--device auto` leaves to the rank."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from h3serve.config.engine_config import EngineConfig
from h3serve.config.offload_config import OffloadConfig
from h3serve.config_checks import check_config, notices
from h3serve.errors import ConfigError
from h3serve.rank.device_checks import check_engine, cpu_threads, resolve_device, start_up_notices

CPU = torch.device("cpu")


def test_cpu_threads_are_shared_between_replicas(tiny_checkpoint):
    config = EngineConfig(model=tiny_checkpoint, device="cpu", data_parallel_size=2)
    assert cpu_threads(config, CPU, cpu_count=8) == 4
    assert cpu_threads(replace(config, threads=3), CPU, cpu_count=8) == 3  # --threads is per rank
    assert cpu_threads(replace(config, data_parallel_size=1), CPU, cpu_count=8) == 0
    assert cpu_threads(config, torch.device("cuda"), cpu_count=8) == 0  # GPU ranks keep torch's default


def test_the_device_and_dtype_resolve_in_the_rank(tiny_checkpoint):
    setup = check_engine(check_config(EngineConfig(model=tiny_checkpoint, device="cpu")))
    assert (setup.device, setup.dtype, setup.attention["self"]) == (CPU, torch.float32, "TORCH_SDPA")
    assert check_engine(EngineConfig(model=tiny_checkpoint, device="cpu", dtype="bfloat16")).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"^--device: unknown device 'tpu'; choose from: auto, cpu, cuda, cuda:N$"):
        resolve_device(EngineConfig(model=tiny_checkpoint, device="tpu"))  # a config `validate` never saw


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_by_the_rank(tiny_checkpoint):
    config = check_config(EngineConfig(model=tiny_checkpoint, device="cuda"))  # the parent cannot tell
    with pytest.raises(ConfigError, match="^--device: CUDA was requested but no GPU is visible; use --device cpu$"):
        check_engine(config)


def test_notices_auto_left_to_the_rank(tiny_checkpoint):
    offload = OffloadConfig(staged=frozenset({"vae"}))
    auto = EngineConfig(model=tiny_checkpoint, offload=offload, dtype="bfloat16")
    assert notices(auto) == []  # the parent cannot tell the device
    lines = start_up_notices(auto, CPU)
    assert any("offload on CPU" in line for line in lines) and any("--dtype bfloat16 on CPU" in line for line in lines)
    assert start_up_notices(auto, torch.device("cuda")) == []
    named = replace(auto, device="cpu")
    assert notices(named) == lines and start_up_notices(named, CPU) == []  # printed by the parent, once
