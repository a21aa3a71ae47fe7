"""A stand-in for torch.distributed's collectives that checks where their tensors live.

NCCL takes CUDA tensors only, and a CPU tensor handed to an NCCL group fails at run time, on a GPU: no CPU test
sees it. `CollectiveDevices` replaces the collectives and `get_backend` with fakes that record every call and
fail unless each tensor is on a device its group's backend serves. Run the code under test inside a
`FakeTensorMode`, and CUDA tensors exist on a CPU-only machine too (shapes and devices, no data).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from h3serve.accel.quantize import backend_device_types

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "gather",
    "all_to_all_single",
)


@dataclass
class FakeGroup:
    """A process group as far as the fakes are concerned: its backend string."""

    backend: str


@dataclass
class CollectiveDevices:
    """Installed by `install`: `calls` holds (collective, backend, device types of its tensors) in call order."""

    default_backend: str = "nccl"
    calls: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)

    def backend_of(self, group: object | None) -> str:
        return group.backend if isinstance(group, FakeGroup) else self.default_backend

    def install(self, monkeypatch: pytest.MonkeyPatch, current_gpu: int = 0) -> CollectiveDevices:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: self.backend_of(group))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current_gpu)
        for name in COLLECTIVES:
            monkeypatch.setattr(dist, name, self._fake(name), raising=False)
        return self

    def _fake(self, name: str):
        def collective(*args, group: object | None = None, **kwargs) -> None:
            tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, list) else [a])]
            devices = tuple(t.device.type for t in tensors if isinstance(t, torch.Tensor))
            backend = self.backend_of(group)
            self.calls.append((name, backend, devices))
            served = backend_device_types(backend)
            wrong = [d for d in devices if d not in served]
            assert not wrong, f"{name} on a {backend} group got tensors on {wrong}; it serves {served}"

        return collective
