"""The H3 generation pipeline: encode text -> lay out rows -> denoise -> decode video and audio.

One `GenerationPlan` in, one `GenerationResult` out, in three stages the pipeline owns: its `RequestEncoder`
(request_encoder.py), its `Sampler` (sampler.py) and its `Decoder` (decoder.py); a long video by continuation runs
the same three through its `Continuation` (continuation.py). A plan of several outputs (output i: the request at
seed + i) encodes once and denoises its outputs in batches of up to `output_batch`, where each item steps as it
would alone; a continuation, an edit or a cached request runs its outputs one after another. The components are
plain torch modules; loading them is `h3serve.loading.components`'s job.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from h3serve.model.adaln_memo import AdaLNMemo
from h3serve.model.continuation import Continuation
from h3serve.model.decoder import Decoder
from h3serve.model.pipeline_types import (
    BlockCache,
    Conditioning,
    Encoded,
    FrameSink,
    GenerationResult,
    H3Components,
    LatentTarget,
    NoHooks,
    StageClock,
    StageHooks,
    StepCallback,
)
from h3serve.model.request_encoder import RequestEncoder
from h3serve.model.sampler import Sampler
from h3serve.rules.validate import GenerationPlan


class H3Pipeline:
    """Runs T2VA, FL2VA and Ref2VA requests on loaded components. Stateless between requests."""

    def __init__(
        self,
        components: H3Components,
        device: str | torch.device = "cpu",
        hooks: StageHooks | None = None,
        cache: BlockCache | None = None,  # the DiT block cache (h3serve.accel.cache); None: every block runs
        adaln: AdaLNMemo | None = None,  # AdaLN modulations computed ahead and memoised; None: in each forward
        output_batch: int = 1,  # several outputs of one plan: at most this many per DiT batch
    ):
        self.components = components
        self.device = torch.device(device)
        self.hooks = hooks or NoHooks()
        self.cache = cache
        self.output_batch = output_batch
        self.encoder = RequestEncoder(components, self.device)
        self.sampler = Sampler(components, self.device, adaln)
        self.decoder = Decoder(components, self.device)
        self.continuation = Continuation(self.encoder, self.sampler, self.decoder)

    @torch.no_grad()
    def generate(
        self,
        plan: GenerationPlan,
        conditioning: Conditioning | None = None,
        on_step: StepCallback | None = None,
        sink: FrameSink | None = None,
        output_batch: int | None = None,  # several outputs: at most this many per DiT batch; None: the pipeline's
    ) -> GenerationResult:
        """Run one plan. With a `sink` the video is streamed into it clip by clip (the result holds no frames);
        without one it is decoded whole into `result.video`. A plan of several outputs returns output 0 with the
        others in `result.others` (output i streamed into `sink.for_output(i)`); its stage times are the whole
        run's and progress counts every output's forwards."""
        cond = conditioning or Conditioning()
        with self.hooks.request(plan.task):
            clock = StageClock(self.device, self.hooks)
            if plan.num_outputs > 1:
                return self._several(plan, cond, clock, on_step, sink, output_batch or self.output_batch)
            if plan.continuation:
                return self.continuation.generate(plan, cond, clock, on_step, sink)
            return self._generate(plan, cond, clock, on_step, (plan.seed,), [sink])[0]

    def _several(
        self,
        plan: GenerationPlan,
        cond: Conditioning,
        clock: StageClock,
        on_step: StepCallback | None,
        sink: FrameSink | None,
        output_batch: int,
    ) -> GenerationResult:
        """Outputs 0..N-1 of `plan`: in batches of `output_batch` where every item steps alone (no edit, no
        continuation, no block cache), else one after another; one progress count over all of them."""
        count = plan.num_outputs
        sinks = [sink, *(None if sink is None else sink.for_output(i) for i in range(1, count))]
        batched = not (plan.continuation or plan.edit or (self.cache is not None and self.cache.active(plan.quality)))
        size = output_batch if batched else 1
        results: list[GenerationResult] = []
        for start in range(0, count, size):
            items = range(start, min(start + size, count))
            progress = _outputs_progress(on_step, start, len(items), count)
            if plan.continuation:
                results.append(self.continuation.generate(plan.output(start), cond, clock, progress, sinks[start]))
            else:
                seeds = tuple(plan.output(i).seed for i in items)
                results += self._generate(plan, cond, clock, progress, seeds, [sinks[i] for i in items])
        first, *others = results
        first.others = others
        return first

    def _generate(
        self,
        plan: GenerationPlan,
        cond: Conditioning,
        clock: StageClock,
        on_step: StepCallback | None,
        seeds: tuple[int, ...],
        sinks: list[FrameSink | None],
    ) -> list[GenerationResult]:
        """Outputs of `plan` that differ only in their seed: one encode, one (batched) denoise, a decode each. A
        request under the block cache or with an edit comes with one seed (`_several` runs those one by one)."""
        enc = self.encoder.encode(plan, cond, clock)
        dit = self.components.transformer_ref if cond.references else self.components.transformer
        edits = self.encoder.edit_targets(plan, cond, clock) if plan.edit else (None, None)
        forwards = len(self.sampler.schedules(plan)[0])
        cached = self.cache is not None and dit is not None
        refresh = plan.force_refresh
        with self.cache.for_request(dit, plan.quality, forwards, refresh) if cached else nullcontext() as cache:
            latents = self.sampler.sample_batch(plan, enc, dit, LatentTarget.of(plan), seeds, clock, on_step, edits)
        clock.record_denoise_per_step()
        return [self.decoder.decode(video, audio, clock, cache, sink)
                for (video, audio), sink in zip(latents, sinks, strict=True)]

    @torch.no_grad()
    def encode(self, plan: GenerationPlan, cond: Conditioning, clock: StageClock | None = None) -> Encoded:
        """Presentation -> text states, condition latents and the packed layout (the first stage alone)."""
        return self.encoder.encode(plan, cond, clock or StageClock(self.device, self.hooks))


def _outputs_progress(on_step: StepCallback | None, first: int, items: int, count: int) -> StepCallback | None:
    """Progress of outputs first..first+items-1 (run together) as a count over all `count` outputs."""
    if on_step is None:
        return None

    def progress(done: int, total: int) -> None:
        on_step(first * total + done * items, count * total)

    return progress
