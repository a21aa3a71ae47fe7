"""How long each `train-demo` stage takes: the recipe's counts times measured costs (`train-demo --plan`).

A DiT step's cost depends on the layout of the batch it draws: a long (4 s) clip has ~1.8 times the rows of a short
(2.3 s) one, keyframes, references and a continuation's guide add rows. A step draws a layout group with a
probability proportional to its size (dit.DiTTrainer), so a phase's mean step cost is its examples' mean cost, and
`measure_step_seconds` measures each kind's cost on this machine (batch and replicas as the recipe trains them).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from h3serve.checkpoint.resolver import read_layout
from h3serve.demo.training.dit import DiTTrainer, Phase, training_init_
from h3serve.demo.training.examples import Example, ExampleBuilder, render
from h3serve.demo.training.stages import Stage, describe_device, plan_stages
from h3serve.demo.training.train import (
    CLIP_FRAMES,
    CONTINUATION_FRAMES,
    PRESET,
    SHORT_CLIP_FRAMES,
    Recipe,
)
from h3serve.demo.world import scenes as world
from h3serve.loading.components import load_components
from h3serve.tools.tiny.make_checkpoint import build_tiny_checkpoint

# Kinds of examples, by what decides a step's cost: the clip's length and the condition rows.
KINDS = ("t2va", "t2va_short", "fl2va", "fl2va_short", "ref2va", "ref2va_short", "continuation")


@dataclass(frozen=True)
class Costs:
    """Seconds per unit of work on one machine: a VAE step, a laid-out example, a DiT step of each kind."""

    machine: str
    video_vae_step: float
    audio_vae_step: float
    example: float
    dit_step: dict[str, float]
    checkpoint: float = 20.0  # seconds: the weights written and the loss plot drawn


# Run 15 on 2 AMD EPYC cores, nothing else running (docs/demo_lab_notebook.md): video VAE 6.5 minutes for 900
# steps, audio VAE 3.1 for 600, examples 4.6 for 840 (with the latent statistics), `transformer` 26.1 for 4,000
# steps and `transformer_ref` 15.6 for 1,720. The DiT steps' costs per kind were measured twice in issue 53's session
# (`train-demo --plan --measure`, 2 AMD EPYC cores shared with eight other jobs, so about ten times slower; the mean
# of the two: t2va 5.21 s, t2va_short 2.48, fl2va 5.26, fl2va_short 2.44, ref2va 8.47, ref2va_short 4.60,
# continuation 6.96, each within 20 % of either measurement) and scaled, `transformer`'s kinds by 0.109 and
# `transformer_ref`'s by 0.085, so that run 15's two DiT stages come out at their recorded minutes.
CPU_2_CORES = Costs(
    machine="2 CPU cores (run 15's AMD EPYC, alone)",
    video_vae_step=6.5 * 60 / 900,
    audio_vae_step=3.1 * 60 / 600,
    example=4.6 * 60 / 840,
    dit_step={"t2va": 0.569, "t2va_short": 0.271, "fl2va": 0.574, "fl2va_short": 0.267, "ref2va": 0.721,
              "ref2va_short": 0.392, "continuation": 0.592},
)
# One H200 (docs/benchmarks.md, the H200 sweep): a batch-8 step of the demo DiT took 44-45 ms with three trainers
# sharing the GPU (launch-bound, so about the same for every kind, and about what one trainer alone takes); the
# examples of run 15's recipe laid out in 115 s on its 16 CPU cores against 254 s on 2. Its VAE steps were not
# measured: a fifth of the CPU's is assumed.
H200 = Costs(
    machine="one NVIDIA H200 (DiT steps launch-bound; VAE steps assumed)",
    video_vae_step=CPU_2_CORES.video_vae_step / 5,
    audio_vae_step=CPU_2_CORES.audio_vae_step / 5,
    example=CPU_2_CORES.example * 115 / 254,
    dit_step=dict.fromkeys(KINDS, 0.045),
)
COSTS = {"cpu": CPU_2_CORES, "cuda": H200}


def example_counts(recipe: Recipe) -> dict[str, dict[str, int]]:
    """How many examples of each kind each DiT's ladder phase trains on (the prior phases: T2VA, or the ladder's
    own mix), as `train.build_examples` and `train.dit_phases` lay them out."""
    transformer = {"t2va": recipe.t2va_clips, "t2va_short": recipe.t2va_short_clips, "fl2va": recipe.fl2va_clips,
                   "fl2va_short": recipe.fl2va_short_clips}
    ref = {"ref2va": 2 * recipe.ref2va_clips, "ref2va_short": 2 * recipe.ref2va_short_clips,
           "t2va": recipe.t2va_clips + recipe.continuation_clips,  # a continuation's first window is laid out as T2VA
           "continuation": 2 * recipe.continuation_clips}
    return {"transformer": transformer, "transformer_ref": ref}


def _mean_step(counts: dict[str, int], costs: Costs) -> float:
    total = sum(counts.values())
    return sum(n * costs.dit_step[kind] for kind, n in counts.items()) / max(1, total)


def stage_seconds(recipe: Recipe, stage: Stage, costs: Costs) -> float:
    """The stage's estimated seconds on the machine `costs` describes."""
    if stage.name == "video_vae":
        return stage.steps * costs.video_vae_step
    if stage.name == "audio_vae":
        return stage.steps * costs.audio_vae_step
    if stage.name == "examples":
        counts = example_counts(recipe)
        examples = sum(counts["transformer"].values()) + sum(counts["transformer_ref"].values()) - recipe.t2va_clips
        return examples * costs.example
    if stage.name == "checkpoint":
        return costs.checkpoint
    counts = example_counts(recipe)[stage.name]
    prior = recipe.dit_prior_steps if stage.name == "transformer" else recipe.ref_prior_steps
    prior_counts = {"t2va": recipe.t2va_clips, "t2va_short": recipe.t2va_short_clips} if (
        stage.name == "transformer") else counts
    in_prior = max(0, min(stage.until, prior) - stage.start)
    return in_prior * _mean_step(prior_counts, costs) + (stage.steps - in_prior) * _mean_step(counts, costs)


def plan_minutes(recipe: Recipe, costs: Costs) -> list[tuple[Stage, float]]:
    """Every stage with its estimated minutes."""
    return [(stage, stage_seconds(recipe, stage, costs) / 60) for stage in plan_stages(recipe)]


def format_plan(recipe: Recipe, costs: Costs, name: str) -> str:
    """`train-demo --plan`'s table: each stage's steps and estimated minutes, and the total."""
    rows = plan_minutes(recipe, costs)
    lines = [f"recipe {name} on {costs.machine}:", f"  {'stage':<18}{'steps':>8}{'minutes':>10}"]
    lines += [f"  {stage.label:<18}{stage.steps or '':>8}{minutes:>10.1f}" for stage, minutes in rows]
    total = sum(minutes for _, minutes in rows)
    lines.append(f"  {'total':<18}{'':>8}{total:>10.1f}  ({total / 60:.1f} hours)")
    return "\n".join(lines)


def _kind_examples(builder: ExampleBuilder, rng: np.random.Generator) -> dict[str, list[Example]]:
    """Two examples of each kind, laid out on `builder` (one layout group each: the same prompt)."""
    attrs = world.random_attributes(rng)
    examples: dict[str, list[Example]] = {}
    for kind, frames in (("t2va", CLIP_FRAMES), ("t2va_short", SHORT_CLIP_FRAMES), ("fl2va", CLIP_FRAMES),
                         ("fl2va_short", SHORT_CLIP_FRAMES), ("ref2va", CLIP_FRAMES),
                         ("ref2va_short", SHORT_CLIP_FRAMES)):
        clips = [render(world.sample_scene(rng, "fl2va", 128, 64, frames, attrs)) for _ in range(2)]
        if kind.startswith("t2va"):
            examples[kind] = [builder.keyframes(clip, ()) for clip in clips]
        elif kind.startswith("fl2va"):
            examples[kind] = [builder.keyframes(clip, ("first",)) for clip in clips]
        else:
            examples[kind] = [builder.references(clip, True) for clip in clips]
    clip = render(world.sample_scene(rng, "t2va", 128, 64, CONTINUATION_FRAMES, attrs))
    examples["continuation"] = builder.continuation(clip, CLIP_FRAMES)[1:]  # the guided windows
    return examples


def measure_step_seconds(components, builder: ExampleBuilder, recipe: Recipe, rounds: int = 3,
                         log: Callable[[str], None] = print) -> dict[str, float]:
    """Each kind's seconds per DiT step (batch and replicas as `recipe`), on `components`' `transformer`: the median
    over `rounds` rounds of one step of each kind in turn, after a warm-up round (taking the kinds in turn keeps a
    machine whose load changes from favouring one kind)."""
    dit = components.transformer
    training_init_(dit)
    times: dict[str, list[float]] = {}
    trainers = {kind: DiTTrainer(dit, [Phase(examples, rounds + 1)], 0, lambda *_: None, kind,
                                 batch=recipe.dit_batch, lr=1e-4, replicas=recipe.dit_replicas)
                for kind, examples in _kind_examples(builder, np.random.default_rng(0)).items()}
    for round_ in range(rounds + 1):
        for kind, trainer in trainers.items():
            began = time.perf_counter()
            trainer.run(round_ + 1)
            if round_:
                times.setdefault(kind, []).append(time.perf_counter() - began)
    for trainer in trainers.values():
        trainer.parallel.close()
    dit.eval().requires_grad_(False)
    seconds = {kind: float(np.median(values)) for kind, values in times.items()}
    for kind, value in seconds.items():
        log(f"  {kind:<14}{value:.3f} s a step")
    return seconds


def measured_costs(recipe: Recipe) -> Costs:
    """`CPU_2_CORES` with the DiT steps measured on this machine's CPU (on the seed's random demo checkpoint: a step
    costs the same whatever the weights)."""
    with tempfile.TemporaryDirectory(prefix="h3serve-demo-plan-") as tmp:
        staging = build_tiny_checkpoint(Path(tmp) / "random", seed=recipe.seed, preset=PRESET)
        layout = read_layout(staging)
        components = load_components(layout, lean_audio_decode=False)  # as the trainer loads them
        builder = ExampleBuilder(components, 128, 64, layout.defaults().reference_image_short_edge)
        print(f"measuring a DiT step of each kind on {describe_device(torch.device('cpu'))}:")
        seconds = measure_step_seconds(components, builder, recipe)
    base = CPU_2_CORES
    return dataclasses.replace(base, machine=f"this CPU (DiT steps measured; VAEs and examples as on {base.machine})",
                               dit_step=seconds)
