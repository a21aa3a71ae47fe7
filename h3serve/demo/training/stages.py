"""`train-demo` in resumable stages: the demo checkpoint trained into a folder that can stop and go on.

The stages, in order: `video_vae`, `audio_vae`, `examples` (the latent statistics and every laid-out example), the
DiT stages `transformer.1` ... and `transformer_ref.1` ... (each DiT's steps cut into parts of at most
`Recipe.dit_stage_steps`, so no stage runs much over ~50 minutes on two CPU cores), and `checkpoint` (the weights
written into the folder). While it trains, the folder holds only `training_state/`:
- `state.json`: the recipe, the stages done (minutes and device each), the sessions (each run of the command);
- `random/`: the seed's random checkpoint, its text encoder frozen (every stage's starting weights);
- `vae.safetensors`, `audio_vae.safetensors`, `latent_stats.json`, `examples.safetensors` (with its `.json` and
  `examples_split.json`), `transformer.safetensors`, `transformer_ref.safetensors`: what each finished stage made, bit
  for bit;
- `transformer.pt` / `transformer_ref.pt`: a DiT's trainer at its last step (weights, AdamW moments, EMA, step,
  the batch rng, the replicas' noise generators), with torch's global rng;
- `rng.pt`: torch's global rng at the last stage boundary; `losses.json`: every logged loss.
A session stops cleanly when `stop()` turns true (a time budget spent, SIGINT or SIGTERM): before the next stage,
or between two DiT steps, after saving the trainer. A resumed session loads what the stages made, restores the rngs
and goes on, so the finished checkpoint is bit for bit the one an uninterrupted run writes on the same machine
(tests/demo/training/test_stages.py). When `checkpoint` is done the folder is the checkpoint, with
`training.json` (the recipe, the device, each stage's minutes) and `losses.png`, and `training_state/` is removed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from h3serve.checkpoint.resolver import read_layout
from h3serve.demo.training import saved
from h3serve.demo.training.dit import DiTTrainer, Phase, intra_op_threads, training_init_
from h3serve.demo.training.examples import Example, ExampleBuilder
from h3serve.demo.training.train import (
    LOSS_PLOT,
    PRESET,
    RUN16,
    TRAINING_FILE,
    Recipe,
    build_examples,
    dit_phases,
    freeze_text_encoder,
    plot_losses,
    write_checkpoint,
)
from h3serve.demo.training.vaes import Canvas, set_latent_stats, train_audio_vae, train_video_vae
from h3serve.loading.components import load_components
from h3serve.tools.tiny.build_files import write_json
from h3serve.tools.tiny.make_checkpoint import build_tiny_checkpoint

STATE_DIR = "training_state"
STATE_FILE = "state.json"
DITS = ("transformer", "transformer_ref")
# The seed offsets of each stage's draws (the recipe's seed plus these), as `train-demo` always drew them.
VIDEO_VAE_SEED, AUDIO_VAE_SEED, LATENT_STATS_SEED = 0, 1, 2
DIT_SEEDS = {"transformer": 3, "transformer_ref": 4}

Stop = Callable[[], bool]


@dataclass(frozen=True)
class Stage:
    """One stage: a name and, for a DiT's part, the global steps [start, until) it trains."""

    name: str
    part: int = 0
    parts: int = 1
    start: int = 0
    until: int = 0

    @property
    def label(self) -> str:
        return f"{self.name}.{self.part + 1}" if self.name in DITS else self.name

    @property
    def steps(self) -> int:
        return self.until - self.start


def dit_steps(recipe: Recipe) -> dict[str, int]:
    """Each DiT's optimizer steps over all its phases."""
    return {"transformer": recipe.dit_prior_steps + recipe.dit_steps,
            "transformer_ref": recipe.ref_prior_steps + recipe.ref_dit_steps}


def plan_stages(recipe: Recipe) -> list[Stage]:
    """The stages of `recipe`, in order; each DiT's steps in as few even parts as keep each at most
    `dit_stage_steps`."""
    stages = [Stage("video_vae", until=recipe.video_vae_steps), Stage("audio_vae", until=recipe.audio_vae_steps),
              Stage("examples")]
    for name, total in dit_steps(recipe).items():
        parts = max(1, math.ceil(total / recipe.dit_stage_steps))
        bounds = [round(total * k / parts) for k in range(parts + 1)]
        stages += [Stage(name, k, parts, bounds[k], bounds[k + 1]) for k in range(parts)]
    return [*stages, Stage("checkpoint")]


def describe_device(device: torch.device) -> str:
    """The device in words, for `training.json`: the GPU's name, or the CPU's model and torch's thread count."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {model}, {torch.get_num_threads()} threads"


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _example_to(example: Example, device: torch.device) -> Example:
    """The example's tensors on `device` (the layout's row roles stay on the CPU, where the row times are made)."""
    if device.type == "cpu":
        return example
    layout = example.layout
    packed = layout.packed.to(device)
    moved = {k: getattr(example, k).to(device) for k in ("text_states", "conditions", "audio_references", "video",
                                                           "audio")}
    return dataclasses.replace(example, layout=dataclasses.replace(layout, packed=packed), **moved)


class _Bar:
    """One tqdm bar over every stage's steps (starting at those done), and every logged loss, per stage name."""

    def __init__(self, total: int, losses: dict[str, list[float]], enabled: bool):
        self.losses = losses
        done = sum(len(v) for v in losses.values())
        self.bar = tqdm(total=total, initial=done, disable=not enabled, unit="step", dynamic_ncols=True)

    def log(self, stage: str, step: int, loss: float) -> None:
        self.losses.setdefault(stage, []).append(loss)
        self.bar.set_description(stage)
        self.bar.set_postfix(loss=f"{loss:.4f}")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class DemoTraining:
    """A `train-demo` folder (`out`): `start` one, `resume` one, `run` its stages."""

    def __init__(self, out: Path, state: dict, device: torch.device, progress: bool):
        self.out = Path(out)
        self.folder = self.out / STATE_DIR
        self.state = state
        self.recipe = Recipe(**state["recipe"])
        self.device = device
        self.progress = progress
        self.canvas = Canvas()
        self.stages = plan_stages(self.recipe)
        self.components = None
        self.examples: dict[str, list[Example]] | None = None
        self.trainers: dict[str, DiTTrainer] = {}

    # -- the folder ---------------------------------------------------------------------------------------------

    @classmethod
    def start(cls, out: str | Path, recipe: Recipe, device: str | torch.device = "cpu", progress: bool = True,
              recipe_name: str | None = None) -> DemoTraining:
        """A new training in `out` (absent or empty): the seed's random checkpoint built, its text encoder frozen."""
        out = Path(out)
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"refusing to train the demo checkpoint into non-empty directory {out}")
        folder = out / STATE_DIR
        folder.mkdir(parents=True)
        staging = build_tiny_checkpoint(folder / "random", seed=recipe.seed, preset=PRESET)
        freeze_text_encoder(staging)
        state = {"recipe": asdict(recipe), "recipe_name": recipe_name, "stages": {}, "sessions": [],
                 "started": datetime.now(UTC).isoformat(timespec="seconds")}
        training = cls(out, state, torch.device(device), progress)
        training._save_state()
        return training

    @classmethod
    def resume(cls, out: str | Path, device: str | torch.device | None = None, progress: bool = True
               ) -> DemoTraining:
        """The training in `out`, to go on (on `device`, else the one it last ran on)."""
        path = Path(out) / STATE_DIR / STATE_FILE
        if not path.is_file():
            if (Path(out) / TRAINING_FILE).is_file():
                raise FileExistsError(f"{out} holds a finished demo checkpoint: nothing to resume")
            raise FileNotFoundError(f"{out} holds no demo training to resume (no {STATE_DIR}/{STATE_FILE})")
        state = json.loads(path.read_text(encoding="utf-8"))
        if device is None:
            device = state["sessions"][-1]["device_type"] if state["sessions"] else "cpu"
        return cls(Path(out), state, torch.device(device), progress)

    def _save_state(self) -> None:
        saved.write_text(self.folder / STATE_FILE, json.dumps(self.state, indent=1, sort_keys=True) + "\n")

    def done(self, stage: Stage) -> bool:
        return self.state["stages"].get(stage.label, {}).get("done", False)

    @property
    def remaining(self) -> list[Stage]:
        return [stage for stage in self.stages if not self.done(stage)]

    # -- running ------------------------------------------------------------------------------------------------

    def run(self, stop: Stop | None = None) -> bool:
        """Run the stages left, until they are all done (True: the checkpoint is written) or `stop()` turns true
        (False: the folder holds what the next session needs)."""
        stop = stop or (lambda: False)
        losses = self._load_losses()
        total = sum(stage.steps for stage in self.stages)
        bar = _Bar(total, losses, self.progress)
        session = {"started": datetime.now(UTC).isoformat(timespec="seconds"), "device_type": self.device.type,
                   "device": describe_device(self.device), "stages": []}
        self.state["sessions"].append(session)
        # The thread count set explicitly for the session: a process that set it before (the DiT replicas'
        # `intra_op_threads`, an earlier training in the same process) would otherwise run the VAEs' kernels on
        # other library thread pools than a fresh process (MKL keeps its own count until torch sets it), and a
        # resumed run would round differently from an uninterrupted one.
        with intra_op_threads(torch.get_num_threads()):
            return self._run_stages(stop, bar, losses, session)

    def _run_stages(self, stop: Stop, bar: _Bar, losses: dict[str, list[float]], session: dict) -> bool:
        try:
            for stage in self.remaining:
                if stop():
                    break
                began = time.monotonic()
                finished = self._run_stage(stage, bar, stop)
                record = self.state["stages"].setdefault(stage.label, {"minutes": 0.0, "devices": []})
                record["minutes"] = record["minutes"] + (time.monotonic() - began) / 60
                if session["device"] not in record["devices"]:
                    record["devices"].append(session["device"])
                record["done"] = finished
                session["stages"].append(stage.label)
                if stage.name != "checkpoint":
                    saved.write_text(self.folder / "losses.json", json.dumps(losses))
                    self._save_state()
                if not finished:
                    break
        finally:
            bar.close()
            for trainer in self.trainers.values():
                trainer.parallel.close()
        if self.remaining:
            session["stopped_before"] = self.remaining[0].label
            self._save_state()
            return False
        return True

    def _run_stage(self, stage: Stage, bar: _Bar, stop: Stop) -> bool:
        if stage.name in DITS:
            return self._dit(stage, bar, stop)
        components = self._components()
        if stage.name == "checkpoint":
            self._checkpoint(bar.losses)
            return True
        self._restore_boundary_rng()
        seed = self.recipe.seed
        if stage.name == "video_vae":
            # The video VAE's conv3d weights channels-last while it trains and encodes the examples: its steps and
            # encodes run ~20 % faster on the CPU (the same losses to five digits, rounded differently; run 11).
            vae = components.vae.to(memory_format=torch.channels_last_3d).to(self.device)
            train_video_vae(vae, self.recipe.video_vae_steps, self.canvas, seed + VIDEO_VAE_SEED, bar.log)
            saved.save_module(vae.cpu(), self.folder / "vae.safetensors")
        elif stage.name == "audio_vae":
            audio_vae = components.audio_vae.to(self.device)
            train_audio_vae(audio_vae, self.recipe.audio_vae_steps, seed + AUDIO_VAE_SEED, bar.log)
            saved.save_module(audio_vae.cpu(), self.folder / "audio_vae.safetensors")
        else:
            self._build_examples(components)
        saved.save_state(self.folder / "rng.pt", _rng_state())
        return True

    def _restore_boundary_rng(self) -> None:
        """torch's global rng as the last stage left it (the recipe's seed before the first stage): loading the
        components in a new session may draw from it, and `training_init_` draws the DiT's first weights from it."""
        if (path := self.folder / "rng.pt").exists():
            _restore_rng(saved.load_state(path))
        else:
            torch.manual_seed(self.recipe.seed)

    def _build_examples(self, components) -> None:
        set_latent_stats(components.vae, components.audio_vae, self.canvas, self.recipe.seed + LATENT_STATS_SEED,
                         self.recipe.latent_stat_clips)
        stats = {name: {k: getattr(module.config, k) for k in ("latents_mean", "latents_std")}
                 for name, module in (("vae", components.vae), ("audio_vae", components.audio_vae))}
        components.vae.to(memory_format=torch.channels_last_3d)
        defaults = read_layout(self.folder / "random").defaults()
        builder = ExampleBuilder(components, self.canvas.width, self.canvas.height,
                                 defaults.reference_image_short_edge)
        t2va, plain, referenced = build_examples(builder, self.recipe, self.canvas)
        components.vae.to(memory_format=torch.contiguous_format)
        saved.save_examples(self.folder / "examples.safetensors", plain + referenced)
        saved.write_text(self.folder / "examples_split.json", json.dumps({"t2va": len(t2va), "plain": len(plain)}))
        saved.write_text(self.folder / "latent_stats.json", json.dumps(stats))
        self.examples = {"t2va": t2va, "plain": plain, "referenced": referenced}

    def _dit(self, stage: Stage, bar: _Bar, stop: Stop) -> bool:
        components = self._components()
        name = stage.name
        dit = getattr(components, name)
        trainer = self.trainers.get(name)
        trainer_file = self.folder / f"{name}.pt"
        if trainer is None:
            saved_state = saved.load_state(trainer_file) if trainer_file.exists() else None
            if saved_state is None:  # the DiT's first step
                self._restore_boundary_rng()
                if name == "transformer":
                    training_init_(dit)
                else:  # Ref2VA and the continuation start from what T2VA/FL2VA learned (train.dit_phases)
                    dit.load_state_dict(components.transformer.state_dict())
            dit.to(self.device)
            phases = dit_phases(self.recipe, *self._examples())
            phases = [Phase([_example_to(e, self.device) for e in p.examples], p.steps, p.prior)
                      for p in phases[name]]
            recipe = self.recipe
            lr = recipe.dit_lr if name == "transformer" else recipe.ref_lr
            trainer = DiTTrainer(dit, phases, recipe.seed + DIT_SEEDS[name], bar.log, name, batch=recipe.dit_batch,
                                 lr=lr, replicas=recipe.dit_replicas)
            if saved_state is not None:
                trainer.load_state_dict(saved_state["trainer"])
                _restore_rng(saved_state["rng"])
            self.trainers[name] = trainer
        reached = trainer.run(stage.until, stop)
        if reached < stage.until or stage.part + 1 < stage.parts:
            saved.save_state(trainer_file, {"trainer": trainer.state_dict(), "rng": _rng_state()})
            return reached == stage.until
        trainer.finish()
        del self.trainers[name]
        dit.cpu()
        saved.save_module(dit, self.folder / f"{name}.safetensors")
        saved.save_state(self.folder / "rng.pt", _rng_state())
        trainer_file.unlink(missing_ok=True)
        return True

    def _checkpoint(self, losses: dict[str, list[float]]) -> None:
        components = self._components()
        staging = self.folder / "random"
        write_checkpoint(staging, self.out, components)
        record = self._training_record(losses)
        write_json(self.out / TRAINING_FILE, record)
        plot_losses(losses, self.out / LOSS_PLOT)
        shutil.rmtree(self.folder)

    def _training_record(self, losses: dict[str, list[float]]) -> dict:
        final = {stage: float(np.mean(values[-max(1, len(values) // 20):])) for stage, values in losses.items()}
        stages = self.state["stages"]
        per_stage: dict[str, float] = {}
        for stage in self.stages[:-1]:
            per_stage[stage.name] = per_stage.get(stage.name, 0.0) + stages[stage.label]["minutes"]
        devices = sorted({d for stage in self.stages[:-1] for d in stages[stage.label]["devices"]})
        name = self.state.get("recipe_name")
        return {
            "recipe": asdict(self.recipe),
            "recipe_name": name,
            "device": devices[0] if len(devices) == 1 else devices,
            "minutes": round(sum(per_stage.values()), 1),
            "stage_minutes": {k: round(v, 1) for k, v in per_stage.items()},
            "stages": [{"stage": s.label, "steps": s.steps, "minutes": round(stages[s.label]["minutes"], 1),
                        "devices": stages[s.label]["devices"]} for s in self.stages[:-1]],
            "sessions": len(self.state["sessions"]),
            "final_losses": final,
            "command": (f"h3serve train-demo --out DIR --recipe {name}" if name else
                        f"h3serve train-demo --out DIR --seed {self.recipe.seed}"),
        }

    # -- what the stages made, loaded in a new session ------------------------------------------------------------

    def _components(self):
        """The components, with every finished stage's weights (and the VAEs' latent statistics) in them."""
        if self.components is not None:
            return self.components
        components = load_components(read_layout(self.folder / "random"), lean_audio_decode=False)  # trained as stored
        for name in ("vae", "audio_vae", *DITS):
            if (path := self.folder / f"{name}.safetensors").exists():
                saved.load_module(getattr(components, name), path)
            getattr(components, name).eval().requires_grad_(False)  # as a finished stage leaves it
        if (path := self.folder / "latent_stats.json").exists():
            for name, stats in json.loads(path.read_text(encoding="utf-8")).items():
                getattr(components, name).register_to_config(**stats)
        self.components = components
        return components

    def _examples(self) -> tuple[list[Example], list[Example], list[Example]]:
        if self.examples is None:
            examples = saved.load_examples(self.folder / "examples.safetensors")
            split = json.loads((self.folder / "examples_split.json").read_text(encoding="utf-8"))
            plain = examples[: split["plain"]]
            self.examples = {"t2va": plain[: split["t2va"]], "plain": plain, "referenced": examples[split["plain"]:]}
        return self.examples["t2va"], self.examples["plain"], self.examples["referenced"]

    def _load_losses(self) -> dict[str, list[float]]:
        path = self.folder / "losses.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def train_demo(
    out: str | Path,
    recipe: Recipe = RUN16,
    progress: bool = True,
    device: str | torch.device = "cpu",
    stop: Stop | None = None,
    recipe_name: str | None = None,
) -> Path | None:
    """Train the demo checkpoint into `out` (absent or empty); its path when done, None when `stop()` turned true
    first (`resume_demo` goes on)."""
    training = DemoTraining.start(out, recipe, device, progress, recipe_name)
    return training.out if training.run(stop) else None


def resume_demo(
    out: str | Path, progress: bool = True, device: str | torch.device | None = None, stop: Stop | None = None
) -> Path | None:
    """Go on with the training in `out`; its path when done, None when `stop()` turned true first."""
    training = DemoTraining.resume(out, device, progress)
    return training.out if training.run(stop) else None


class StopSignal:
    """A session's `stop()`: true once `budget_minutes` have passed since the block began, or after SIGINT or
    SIGTERM (handlers installed for the block, in the main thread; the previous ones restored after). A second
    SIGINT interrupts at once. `reason` says which."""

    def __init__(self, budget_minutes: float | None = None):
        self.budget = None if budget_minutes is None else budget_minutes * 60
        self.reason = ""
        self._began = time.monotonic()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignal:
        self._began = time.monotonic()
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.reason.startswith("SIGINT") and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = f"{signal.Signals(signum).name} received"

    def __call__(self) -> bool:
        if not self.reason and self.budget is not None and time.monotonic() - self._began >= self.budget:
            self.reason = f"the budget of {self.budget / 60:g} minutes spent"
        return bool(self.reason)
