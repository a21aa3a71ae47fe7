"""Random weights, reproducibly: a generator per component (derived from the seed and its name), draws in float64
rounded once, so the same preset and seed give the same bits on any CPU."""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
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


# A tensor above this many elements is drawn in chunks on every core: one generator per chunk, seeded from one draw
# of the component's generator and the chunk's index, so its bits do not depend on the thread count. The released
# DiT's width (the `gpu-accept` preset: 3.4 B parameters) took over 75 s to draw on one core; every tensor of the
# CPU presets is far below this, so their bits are unchanged.
CHUNKED_DRAW_ELEMENTS = 1 << 24
DRAW_CHUNK_ELEMENTS = 1 << 22


def _draw_like(param: nn.Parameter, generator: Generator) -> torch.Tensor:
    import torch

    flat = param.detach().reshape(-1)
    constant = flat.numel() > 1 and bool((flat == flat[0]).all())
    fan_in = param.numel() // param.shape[0] if param.dim() >= 2 else 0
    if param.numel() > CHUNKED_DRAW_ELEMENTS:
        offset, scale = (float(flat[0]), 0.1) if constant else (0.0, 1 / math.sqrt(fan_in) if fan_in else 0.02)
        return _draw_chunked(param, generator, offset, scale)
    noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
    if constant:
        return float(flat[0]) + 0.1 * noise
    if fan_in:
        return noise / math.sqrt(fan_in)
    return 0.02 * noise


def _draw_chunked(param: nn.Parameter, generator: Generator, offset: float, scale: float) -> torch.Tensor:
    """offset + scale · N(0, 1) in `param`'s dtype, drawn in float64 chunks on a thread pool (torch frees the GIL)."""
    import torch

    base = int(torch.randint(2**62, (1,), generator=generator))
    out = torch.empty(param.numel(), dtype=param.dtype)

    def fill(index: int) -> None:
        start = index * DRAW_CHUNK_ELEMENTS
        stop = min(out.numel(), start + DRAW_CHUNK_ELEMENTS)
        chunk_generator = torch.Generator().manual_seed(derive_seed(base, f"chunk/{index}"))
        noise = torch.randn(stop - start, generator=chunk_generator, dtype=torch.float64)
        out[start:stop] = offset + scale * noise

    chunks = -(-out.numel() // DRAW_CHUNK_ELEMENTS)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(fill, range(chunks)))
    return out.view(param.shape)


def latent_stats(generator: Generator, channels: int) -> tuple[list[float], list[float]]:
    """Random per-channel ``latents_mean`` / ``latents_std``, rounded to keep the JSON short."""
    import torch

    mean = 0.5 * torch.randn(channels, generator=generator, dtype=torch.float64)
    std = 0.5 + torch.rand(channels, generator=generator, dtype=torch.float64)
    return [round(v, 4) for v in mean.tolist()], [round(v, 4) for v in std.tolist()]
