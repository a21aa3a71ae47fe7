"""An adapter as edits of the DiT's parameters, fused into the weights while they load (torch-free).

`W += scale · B@A` for each low-rank pair, plus `.diff` tensors added as they are, all in fp32 before any sharding,
FP8 step or offload (h3serve.loading.fasth3_fusion applies them). Two adapters take this form: FastVideo's FastH3
export (scale exactly 1; h3serve.adapters.fasth3) and, under `--merge-lora`, the server's one LoRA adapter at its
scale · alpha / rank (`lora_edits`): a dedicated server then runs a Turbo forward at the cost of a base forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from h3serve.adapters.peft import LoraFile


@dataclass(frozen=True)
class WeightEdits:
    """Which tensors of the adapter file `path` edit which parameter of the DiT."""

    path: Path
    low_rank: dict[str, tuple[str, str]]  # "<module>.weight" -> (lora_A key, lora_B key): W += scale · B@A
    diffs: dict[str, str] = field(default_factory=dict)  # "<module>.weight" / "<module>.bias" -> key: added as is
    scale: float = 1.0  # of the low-rank products only

    @property
    def edited(self) -> set[str]:
        return set(self.low_rank) | set(self.diffs)


def lora_edits(info: LoraFile, scale: float) -> WeightEdits:
    """A checked LoRA file merged at request scale `scale`: every target's `W += scale · alpha / r · B@A`, the
    product the unmerged wrapper adds to the layer's output (h3serve.rank.lora)."""
    low_rank = {f"{module}.weight": keys for module, keys in info.keys.items()}
    return WeightEdits(info.path, low_rank, {}, scale * info.unit_scale)
