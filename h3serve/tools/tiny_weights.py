"""Random weights, reproducibly: a generator per component (derived from the seed and its name), draws in float64
rounded once, so the same preset and seed give the same bits on any CPU."""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Generator, nn


def derive_seed(seed: int, name: str) -> int:
    """A per-component seed, so that each component's weights do not depend on the others."""
    digest = hashlib.sha256(f"h3serve-tiny-checkpoint/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def generator_for(seed: int, name: str) -> Generator:
    import torch

    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, name))


# --------------------------------------------------------------------------------------------------------------------
# Helpers: weights


def construct(factory: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a module constructor without touching the caller's global RNG (its random init is overwritten)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        return factory(*args, **kwargs)


def randomize_(module: nn.Module, generator: Generator) -> None:
    """Overwrite every parameter of ``module`` in place with draws from ``generator``.

    Parameters the constructor set to a constant (norm weights, zero biases, gates, Snake alphas) become that
    constant plus N(0, 0.1²) noise; other matrices get N(0, 1/fan_in) and other vectors N(0, 0.02²). A weight-norm
    gain ``weight_g`` is the norm of its ``weight_v`` times a factor in [0.5, 1.5]. Buffers (filters, RoPE tables)
    are kept. Values are computed in float64 and rounded once, so the bits do not depend on the CPU's SIMD paths.
    """
    import torch

    with torch.no_grad():
        gains = []
        for name, param in module.named_parameters():
            if name.endswith("weight_g"):
                gains.append((name, param))
            else:
                param.copy_(_draw_like(param, generator))
        for name, gain in gains:
            direction = module.get_parameter(name.removesuffix("g") + "v").double()
            norm = direction.norm(dim=tuple(range(1, direction.dim())), keepdim=True)
            gain.copy_(norm * (0.5 + torch.rand(gain.shape, generator=generator, dtype=torch.float64)))


def _draw_like(param: nn.Parameter, generator: Generator) -> torch.Tensor:
    import torch

    noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
    flat = param.detach().reshape(-1)
    if flat.numel() > 1 and bool((flat == flat[0]).all()):
        return float(flat[0]) + 0.1 * noise
    if param.dim() >= 2:
        return noise / math.sqrt(param.numel() // param.shape[0])
    return 0.02 * noise


def latent_stats(generator: Generator, channels: int) -> tuple[list[float], list[float]]:
    """Random per-channel ``latents_mean`` / ``latents_std``, rounded to keep the JSON short."""
    import torch

    mean = 0.5 * torch.randn(channels, generator=generator, dtype=torch.float64)
    std = 0.5 + torch.rand(channels, generator=generator, dtype=torch.float64)
    return [round(v, 4) for v in mean.tolist()], [round(v, 4) for v in std.tolist()]
