"""The planner's AdaLN terms: where the DiTs' AdaLN projections sit, and the request's modulations on the device.

With the memoisation on (h3serve.model.adaln_memo), a request's modulations are computed before its first step
and stay on the device for the denoise stage: per forward, each block keeps the table rows its tokens read
(3 (timestep, modality) slots for the targets: video and text at t_video, audio at t_audio; one more for condition
images at max(t, 0.999)), `[slots, 6·D]` in the compute dtype, plus norm_out's `[T, 2D]` and a `[T·3]` int64 row
map. Tensor parallelism does not shrink them (the tables are all-gathered whole). Steps whose timestep tuples
repeat share one entry, so this is an upper bound.

With the projections in host memory (`adaln` in the offload components, or streaming the DiT with the memo on),
the DiT's blocks and base lose their AdaLN bytes, and the pseudo-component `adaln` holds all of them in host
memory and one slot (the largest projection) on the device while the modulations are computed.
"""

from __future__ import annotations

from h3serve.model.transformer import NUM_MODALITIES, H3TransformerConfig
from h3serve.offload.activations import RequestShape
from h3serve.offload.inventory import ComponentBytes

TARGET_SLOTS = 3  # video and text rows at t_video, audio rows at t_audio


def slots_per_forward(shape: RequestShape) -> int:
    return TARGET_SLOTS + (1 if shape.images else 0)


def timesteps_per_forward(shape: RequestShape) -> int:
    return 2 + (1 if shape.images else 0)


def modulation_bytes(cfg: H3TransformerConfig, shape: RequestShape, es: int) -> int:
    """The request's modulations on the device (the memo's per-request view), an upper bound."""
    forwards = shape.steps  # steps count denoiser forwards
    t = timesteps_per_forward(shape)
    per_forward = cfg.num_layers * slots_per_forward(shape) * 6 * cfg.hidden_size * es
    per_forward += t * 2 * cfg.hidden_size * es + t * NUM_MODALITIES * 8
    return forwards * per_forward


def adaln_slot(c: ComponentBytes) -> int:
    """The device slot the projections pass through one at a time: the largest of them."""
    return max((*c.adaln_blocks, c.adaln_out), default=0)
