"""`--controlnet-model-path FILE`: the Fun ControlNet Union file (one safetensors, keys without a prefix) read by
exact key match into a `ControlNet` beside the DiT (h3serve.model.controlnet).

Keys: `control_proj_in.{weight [H, 196], bias}` and `control_blocks.{i}.*`, each block a DiT block's keys
(diffusers names; the FFN input stored [value; gate] as h3serve's is) plus `after_proj` and, on block 0,
`before_proj`. A missing, extra or mis-shaped key is refused by name. `control_proj_in` stays fp32.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from h3serve.errors import ConfigError
from h3serve.model.controlnet import ControlNet
from h3serve.model.transformer_config import H3TransformerConfig

_BLOCK = re.compile(r"^control_blocks\.(\d+)\.")


def read_controlnet(path: str | Path, cfg: H3TransformerConfig, device: torch.device, dtype: torch.dtype) -> ControlNet:
    """The control branch of `path` for a DiT of `cfg`, on `device` in `dtype` (its input projection in fp32)."""
    path = Path(path)
    name = path.name
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            blocks = 1 + max((int(m[1]) for k in keys if (m := _BLOCK.match(k))), default=-1)
            if blocks < 1:
                raise ConfigError(f"--controlnet-model-path {name}: no control_blocks.* tensors")
            if blocks > cfg.num_layers:
                raise ConfigError(f"--controlnet-model-path {name}: {blocks} control blocks for {cfg.num_layers} DiT "
                                  "blocks")
            with torch.device("meta"):
                expected = {k: tuple(v.shape) for k, v in ControlNet(cfg, blocks).state_dict().items()}
            extra = sorted(set(keys) - set(expected))
            missing = sorted(set(expected) - set(keys))
            if extra or missing:
                what = f"unexpected key {extra[0]}" if extra else f"missing key {missing[0]}"
                more = len(extra) + len(missing) - 1
                raise ConfigError(f"--controlnet-model-path {name}: {what}" + (f" (and {more} more)" if more else ""))
            state = {}
            for key in keys:
                shape = tuple(f.get_slice(key).get_shape())
                if shape != expected[key]:
                    raise ConfigError(f"--controlnet-model-path {name}: {key} has shape {list(shape)}, expected "
                                      f"{list(expected[key])}")
                state[key] = f.get_tensor(key)
    except (OSError, ValueError) as e:  # not a safetensors file, unreadable
        raise ConfigError(f"--controlnet-model-path {name}: cannot be read ({e})") from None
    net = ControlNet(cfg, blocks)
    net.load_state_dict(state, strict=True)
    net = net.to(device=device, dtype=dtype).eval()
    net.control_proj_in.float()
    return net
