"""Same-run A/B/C of one DiT forward of the cpu-bench checkpoint at the Turbo bench's shape (T2VA 192x128, 107
frames): the base DiT, the Turbo LoRA unmerged (its wrappers) and merged into the weights (`--merge-lora`),
alternated round by round and timed in this process's CPU seconds, which a shared host disturbs far less than wall
time (docs/benchmarks.md, issue 58).

    .venv/bin/h3serve make-tiny-adapter /tmp/h3serve-turbo --format turbo --preset cpu-bench
    .venv/bin/python scripts/merged_forward_ab.py /tmp/h3serve-turbo [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from h3serve.adapters.catalog import adapter_file, lora_file
from h3serve.adapters.peft import target_shapes
from h3serve.adapters.serving import dit_config
from h3serve.adapters.weight_edits import lora_edits
from h3serve.loading.components import load_transformer
from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify
from h3serve.rank.lora import LoraRuntime
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate
from h3serve.tools.tiny.make_checkpoint import ensure_tiny_checkpoint


def main(adapter: Path, rounds: int) -> None:
    torch.set_num_threads(2)
    checkpoint = ensure_tiny_checkpoint("cpu-bench")
    info = lora_file(adapter_file(adapter), target_shapes(dit_config(checkpoint)))
    models = {name: load_transformer(checkpoint / "transformer") for name in ("base", "unmerged")}
    models["merged"] = load_transformer(checkpoint / "transformer", merged=lora_edits(info, 1.0))
    for model in models.values():
        model.fuse_projections()
    choice = AdapterChoice("turbo", str(info.path), 1.0, 1, info.rank, info.alpha)
    LoraRuntime({"transformer": models["unmerged"]}, slot_rank=info.rank).activate("transformer", choice)
    plan = validate(GenerationRequest(prompt="x", width=192, height=128, num_frames=107))
    g = torch.Generator().manual_seed(0)
    text_len = 20
    layout = build_keyframe_layout(torch.full((text_len,), TEXT_TAG), plan.latent_frames, plan.latent_height,
                                   plan.latent_width, plan.audio_latents, ())
    video = patchify(torch.randn(1, 24, plan.latent_frames, plan.latent_height, plan.latent_width, generator=g))[None]
    audio = torch.randn(1, 2 * plan.audio_latents, 32, generator=g)
    text = torch.randn(1, text_len, models["base"].config.text_dim, generator=g)
    timestep, row_index = layout.row_timesteps(0.5, 0.5)

    def forward(model) -> float:
        with torch.inference_mode():
            start = time.process_time()
            model(video, audio, model.embed_text(text), timestep, row_index, layout.packed)
            return time.process_time() - start

    for model in models.values():  # untimed first calls
        forward(model)
    times: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(forward(models[name]))
    for name, values in times.items():
        print(f"{name:9s} CPU s per forward: median {statistics.median(values):.3f}, best {min(values):.3f}")
    for name in ("unmerged", "merged"):
        ratios = [a / b for a, b in zip(times[name], times["base"], strict=True)]
        print(f"{name} / base, per round: median {statistics.median(ratios):.3f} "
              f"({', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8)
