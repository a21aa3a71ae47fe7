"""Flow-matching training of a demo DiT on laid-out examples, with H3's objective.

The sampler (h3serve.model.scheduler) walks x_t = (1 - σ)·x0 + σ·ε from σ = 1 to 0 and reads the model's output as the
data-ward velocity v = x0 - ε (x0 = x_t + σ·v). Training draws one base position b ~ U(0, 1) per batch and maps it
through each modality's released shift (video 12, audio 3), as one sampler step does for both modalities; condition
rows are noise-augmented at t = 0.999 and reference/guide audio rows are clean, exactly as `H3Pipeline._initial_rows`
and `Layout.row_times` lay them out. The loss is the velocity MSE on the generated rows only.

Examples whose packed layouts are equal (same prompt length, same conditions) run as one batch: one forward of B
rows costs ~0.6x of B forwards of one on the CPU. The DiT starts from a training initialisation (adaLN-Zero, zero
output heads), and the weights kept are an exponential moving average of the trained ones.

On the CPU a batch can be split over data-parallel replicas of the DiT on threads, each with one intra-op thread
(`Replicas`): on 2 cores a step of 8 examples takes 0.52 s that way, against 0.57-0.64 s for one replica on 2
intra-op threads (whose small elementwise ops do not split well), and the summed gradients are the batch's up to
rounding.

Training runs in phases (`Phase`), one optimizer and one learning-rate schedule over all of them. A prior phase
draws every batch from the top of the ladder, where x_t holds nothing of the clip: the DiT learns which clip the
prompt asks for (the object's colour, where it is in every latent frame, the pitch) before it learns to denoise, which
it learns quickly. Trained on the whole ladder from the start, the DiT learns to read the clip from x_t first and its
prediction at σ ≈ 1 hardly follows the prompt (docs/demo_lab_notebook.md, runs S-S4). The prior phase must see examples
whose clip the conditions decide: FL2VA examples with random starts taught a smear (the first full run).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from h3serve.demo.training.examples import Example
from h3serve.model.scheduler import scale_noise, shift_sigma
from h3serve.model.transformer import H3Transformer
from h3serve.rules import limits

LossLog = Callable[[str, int, float], None]

# The prompt's pitch and motion are decided in the sampler's first steps, where x_t holds nothing of them; with
# b ~ U(0, 1) only 3 % of examples put the audio above σ = 0.99 (shift 3), and the DiT learns to read the pitch from
# x_t instead of the prompt (measured: at σ_a = 0.997 its prediction did not depend on the prompt). So this share of
# batches is drawn from the top of the ladder instead.
HIGH_NOISE_SHARE = 0.3
HIGH_NOISE_SPAN = 0.1  # b ~ U(1 - span, 1)
PRIOR_SPAN = 0.2  # the first phase's b ~ U(0.8, 1): σ_v >= 0.98 (shift 12), σ_a >= 0.92 (shift 3)
# The loss weight of the target rows a condition row gives (`Example.anchored_rows`: frame 0 under a first keyframe),
# against 1 for the others. Unweighted, frame 0 is one latent frame in 17-32 and the DiT never learnt to copy its
# keyframe (FL2VA's keyframe check failed in 10 cases of 10 in runs 1-4); weighted, in 3 (docs/demo_lab_notebook.md,
# run 5).
ANCHOR_WEIGHT = 10.0
# The loss weight of a bounce's click rows (`Example.click_rows`), against 1 for the other audio rows. A click is one
# latent of 178 per channel in a bouncing 4 s clip; unweighted, run 8's DiT made no click in any bouncing case of any
# task though its audio VAE decodes them all; weighted, 600 steps more made every T2VA bounce click
# (docs/demo_lab_notebook.md).
CLICK_WEIGHT = 10.0


@torch.no_grad()
def training_init_(dit: H3Transformer) -> None:
    """Re-initialise `dit` for training from scratch, as DiTs are: Xavier linears with zero biases, unit norms, a
    small time embedder, and every AdaLN projection and output head at zero, so each block starts as the identity
    (its gates are zero) and the first velocity is zero. Random checkpoint weights (unit-gain, random gates) train
    several times slower."""
    for module in dit.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm) and module.weight is not None:
            nn.init.ones_(module.weight)
    for linear in (dit.time_embedder.linear_1, dit.time_embedder.linear_2):
        nn.init.normal_(linear.weight, std=0.02)
    zeroed = [block.adaln_proj.linear for block in dit.transformer_blocks]
    for linear in (*zeroed, dit.norm_out.linear, dit.proj_out, dit.audio_proj_out):
        nn.init.zeros_(linear.weight)
        nn.init.zeros_(linear.bias)


@dataclass(frozen=True)
class Phase:
    """`steps` optimizer steps on `examples`; with `prior`, every base position from the ladder's top."""

    examples: Sequence[Example]
    steps: int
    prior: bool = False


def layout_key(example: Example) -> str:
    """Examples with equal keys have identical packed layouts and row roles, so they can share one forward."""
    digest = hashlib.sha256()
    packed = example.layout.packed
    for tensor in (packed.position_ids, packed.token_tags, example.layout.roles):
        digest.update(tensor.contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def layout_groups(examples: Sequence[Example]) -> list[list[Example]]:
    """The examples grouped by `layout_key`, in order of first appearance."""
    groups: dict[str, list[Example]] = {}
    for example in examples:
        groups.setdefault(layout_key(example), []).append(example)
    return list(groups.values())


def batch_loss(
    dit: H3Transformer,
    items: Sequence[Example],
    generator: torch.Generator,
    base: float,
    video_shift: float = 12.0,
    audio_shift: float = 3.0,
) -> torch.Tensor:
    """The velocity MSE of a batch of same-layout examples at one base position (video and audio each averaged over
    its own rows; the anchored video rows weighted ANCHOR_WEIGHT and the click rows CLICK_WEIGHT, each modality's
    weights normalised to a mean of 1 over the batch)."""
    layout = items[0].layout
    sigma_v, sigma_a = shift_sigma(base, video_shift), shift_sigma(base, audio_shift)
    video = torch.stack([e.video for e in items])  # [B, Nv, C·4]
    audio = torch.stack([e.audio for e in items])  # [B, 2·A, 32]
    device = video.device  # the examples' and the DiT's; `generator` must be on it too
    eps_v = torch.randn(video.shape, generator=generator, device=device)
    eps_a = torch.randn(audio.shape, generator=generator, device=device)
    conditions = torch.stack([e.conditions for e in items])
    if conditions.shape[1]:
        noise = torch.randn(conditions.shape, generator=generator, device=device)
        conditions = scale_noise(conditions, limits.KEYFRAME_NOISE_AUG_T, noise)
    references = torch.stack([e.audio_references for e in items])
    video_rows = torch.cat([conditions, (1 - sigma_v) * video + sigma_v * eps_v], dim=1)
    audio_rows = torch.cat([references, (1 - sigma_a) * audio + sigma_a * eps_a], dim=1)
    timestep, row_index = layout.row_timesteps(1 - sigma_v, 1 - sigma_a, limits.KEYFRAME_NOISE_AUG_T)
    timestep, row_index = timestep.to(device), row_index.to(device)
    text = dit.embed_text(torch.cat([e.text_states for e in items]))
    v_vel, a_vel = dit(video_rows, audio_rows, text, timestep, row_index, layout.packed)
    nv, na = conditions.shape[1], references.shape[1]
    weight = torch.ones(video.shape[1], 1, device=device)
    weight[: items[0].anchored_rows] = ANCHOR_WEIGHT  # the same for every example of one layout
    video_loss = (weight / weight.mean() * (v_vel[:, nv:] - (video - eps_v)).pow(2)).mean()
    audio_weight = torch.ones(audio.shape[0], audio.shape[1], 1, device=device)
    for row, example in enumerate(items):
        audio_weight[row, list(example.click_rows)] = CLICK_WEIGHT
    audio_loss = (audio_weight / audio_weight.mean() * (a_vel[:, na:] - (audio - eps_a)).pow(2)).mean()
    return video_loss + audio_loss


def draw_base(rng: np.random.Generator, prior: bool = False) -> float:
    """A base position: in the prior phase from the ladder's top PRIOR_SPAN; otherwise uniform, or with probability
    HIGH_NOISE_SHARE from its top HIGH_NOISE_SPAN."""
    if prior:
        return 1.0 - PRIOR_SPAN * float(rng.random())
    if rng.random() < HIGH_NOISE_SHARE:
        return 1.0 - HIGH_NOISE_SPAN * float(rng.random())
    return float(rng.random())


class EMA:
    """An exponential moving average of a module's parameters (decay warmed up over the first steps)."""

    def __init__(self, module: nn.Module, decay: float):
        self.decay = decay
        self.shadow = [p.detach().clone() for p in module.parameters()]

    @torch.no_grad()
    def update(self, module: nn.Module, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        for shadow, param in zip(self.shadow, module.parameters(), strict=True):
            shadow.lerp_(param.detach(), 1 - decay)

    @torch.no_grad()
    def copy_to(self, module: nn.Module) -> None:
        for shadow, param in zip(self.shadow, module.parameters(), strict=True):
            param.copy_(shadow)


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside the block (a process-wide setting), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Replicas:
    """`count` data-parallel replicas of a DiT on threads: `dit` itself and copies of it, each with its own noise
    generator (replica k: seed + 10,000·k, so one replica draws what a single DiT draws). `loss_backward` splits a
    batch into contiguous shards, one a replica, runs them side by side, and leaves in `dit`'s gradients the sum of
    the shards' gradients, each shard's loss weighted by its share of the batch: the batch loss's gradient, to within
    rounding (a shard normalises its click weights over its own examples). Run it with one intra-op thread
    (`intra_op_threads`): the threads are the parallelism. `sync` copies `dit`'s weights to the copies after a step."""

    def __init__(self, dit: H3Transformer, count: int, seed: int):
        device = next(dit.parameters()).device
        self.modules = [dit, *(copy.deepcopy(dit) for _ in range(count - 1))]
        self.generators = [torch.Generator(device).manual_seed(seed + 10_000 * k) for k in range(count)]
        self.pool = ThreadPoolExecutor(count - 1, thread_name_prefix="dit-replica") if count > 1 else None

    def loss_backward(self, items: Sequence[Example], base: float) -> float:
        """Forward and backward of the batch `items` at base position `base`; returns the batch loss."""
        bounds = np.linspace(0, len(items), len(self.modules) + 1).round().astype(int)
        shards = [(k, items[a:b]) for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)) if b > a]
        futures = [self.pool.submit(self._shard, k, shard, base, len(items)) for k, shard in shards[1:]]
        losses = [self._shard(*shards[0], base, len(items)), *(future.result() for future in futures)]
        main = self.modules[0]
        with torch.no_grad():
            for k, _ in shards[1:]:
                for param, other in zip(main.parameters(), self.modules[k].parameters(), strict=True):
                    if other.grad is not None:
                        param.grad = other.grad if param.grad is None else param.grad.add_(other.grad)
                    other.grad = None
        return sum(losses)

    def _shard(self, k: int, shard: Sequence[Example], base: float, batch: int) -> float:
        loss = batch_loss(self.modules[k], shard, self.generators[k], base) * (len(shard) / batch)
        loss.backward()
        return float(loss.detach())

    @torch.no_grad()
    def sync(self) -> None:
        for module in self.modules[1:]:
            for param, other in zip(self.modules[0].parameters(), module.parameters(), strict=True):
                other.copy_(param)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def train_dit(
    dit: H3Transformer,
    phases: Sequence[Phase],
    seed: int,
    log: LossLog,
    name: str,
    *,
    batch: int,
    lr: float,
    replicas: int = 1,
    ema_decay: float = 0.995,
    warmup: int = 50,
) -> None:
    """All of a `DiTTrainer`'s steps in one call; the EMA weights are left in `dit`."""
    trainer = DiTTrainer(dit, phases, seed, log, name, batch=batch, lr=lr, replicas=replicas, ema_decay=ema_decay,
                         warmup=warmup)
    trainer.run(trainer.total)
    trainer.finish()


class DiTTrainer:
    """AdamW over every phase's steps, linear warm-up then one cosine to a tenth of `lr`; each step draws a layout
    group of its phase's examples (weighted by its size), `batch` of its examples (with replacement) and one base
    position (`draw_base`). With `replicas` > 1 (CPU), each batch is split over that many `Replicas` on threads.

    Resumable: `run` goes to a given step (or until `stop()` says so, between steps), and `state_dict` holds all
    that the next step depends on (the weights, the optimizer's moments, the EMA, the step, the rng and the
    replicas' noise generators), so a trainer restored with `load_state_dict` takes the same steps, bit for bit, as
    one that never stopped. `finish` leaves the EMA weights in `dit`. The examples (and `dit`) may live on any
    device; the rng draws stay on the CPU."""

    def __init__(
        self,
        dit: H3Transformer,
        phases: Sequence[Phase],
        seed: int,
        log: LossLog,
        name: str,
        *,
        batch: int,
        lr: float,
        replicas: int = 1,
        ema_decay: float = 0.995,
        warmup: int = 50,
    ):
        self.dit, self.phases, self.log, self.name = dit, list(phases), log, name
        self.batch, self.lr, self.warmup = batch, lr, warmup
        self.rng = np.random.default_rng(seed)
        dit.train().requires_grad_(True)
        self.threads = min(replicas, batch) if next(dit.parameters()).device.type == "cpu" else 1
        self.parallel = Replicas(dit, self.threads, seed)
        self.optimizer = torch.optim.AdamW(dit.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
        self.ema = EMA(dit, ema_decay)
        self.total = sum(phase.steps for phase in phases)
        self.step = 0
        self._groups: dict[int, tuple[list[list[Example]], np.ndarray]] = {}

    def _phase(self, step: int) -> int:
        """The index of the phase global step `step` belongs to."""
        end = 0
        for index, phase in enumerate(self.phases):
            end += phase.steps
            if step < end:
                return index
        raise ValueError(f"step {step} is past the last phase ({self.total} steps)")

    def _layout_groups(self, index: int) -> tuple[list[list[Example]], np.ndarray]:
        if index not in self._groups:
            groups = layout_groups(self.phases[index].examples)
            self._groups[index] = groups, np.array([len(g) for g in groups], dtype=np.float64)
        return self._groups[index]

    def run(self, until: int, stop: Callable[[], bool] | None = None) -> int:
        """Take steps up to global step `until` (at most `total`), or fewer when `stop()` turns true (asked before
        each step); returns the step reached."""
        until = min(until, self.total)
        with intra_op_threads(1) if self.threads > 1 else nullcontext():
            while self.step < until and not (stop is not None and stop()):
                self._take_step()
        return self.step

    def _take_step(self) -> None:
        step = self.step
        index = self._phase(step)
        groups, weights = self._layout_groups(index)
        progress = step / max(1, self.total - 1)
        scale = min(1.0, (step + 1) / self.warmup) * (0.1 + 0.45 * (1 + np.cos(np.pi * progress)))
        for group in self.optimizer.param_groups:
            group["lr"] = float(self.lr * scale)  # the same double as numpy's, and a plain number in the state
        chosen = groups[int(self.rng.choice(len(groups), p=weights / weights.sum()))]
        items = [chosen[int(i)] for i in self.rng.integers(len(chosen), size=self.batch)]
        loss = self.parallel.loss_backward(items, draw_base(self.rng, prior=self.phases[index].prior))
        torch.nn.utils.clip_grad_norm_(self.dit.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.parallel.sync()
        self.ema.update(self.dit, step)
        self.log(self.name, step, loss)
        self.step += 1

    def state_dict(self) -> dict:
        """What the next step depends on, as tensors, numbers and dicts (`torch.save`-able, weights-only)."""
        return {
            "step": self.step,
            "dit": {k: v.detach().clone() for k, v in self.dit.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "ema": [t.clone() for t in self.ema.shadow],
            "rng": json.dumps(self.rng.bit_generator.state, default=int),  # numpy integers as plain ones
            "generators": [g.get_state() for g in self.parallel.generators],
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.dit.load_state_dict(state["dit"])
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for shadow, saved in zip(self.ema.shadow, state["ema"], strict=True):
                shadow.copy_(saved)
        self.rng.bit_generator.state = json.loads(state["rng"])
        for generator, saved in zip(self.parallel.generators, state["generators"], strict=True):
            generator.set_state(saved)
        self.parallel.sync()

    def finish(self) -> None:
        """The EMA weights into `dit`, left in eval mode without gradients; the replicas' threads ended."""
        self.parallel.close()
        self.ema.copy_to(self.dit)
        self.dit.eval().requires_grad_(False)
