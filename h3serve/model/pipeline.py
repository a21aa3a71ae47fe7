"""The H3 generation pipeline: encode text -> lay out rows -> denoise -> decode video and audio.

One `GenerationPlan` in, one `GenerationResult` out, in three stages the pipeline owns: its `RequestEncoder`
(request_encoder.py), its `Sampler` (sampler.py) and its `Decoder` (decoder.py); a long video by continuation runs
the same three through its `Continuation` (continuation.py). The components are plain torch modules; loading them
is `h3serve.rank.checkpoint`'s job.
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
    NoHooks,
    StageClock,
    StageHooks,
    StepCallback,
    Target,
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
    ):
        self.components = components
        self.device = torch.device(device)
        self.hooks = hooks or NoHooks()
        self.cache = cache
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
    ) -> GenerationResult:
        """Run one plan. With a `sink` the video is streamed into it clip by clip (the result holds no frames);
        without one it is decoded whole into `result.video`."""
        cond = conditioning or Conditioning()
        with self.hooks.request(plan.task):
            clock = StageClock(self.device, self.hooks)
            if plan.continuation:
                return self.continuation.generate(plan, cond, clock, on_step, sink)
            return self._generate(plan, cond, clock, on_step, sink)

    def _generate(
        self,
        plan: GenerationPlan,
        cond: Conditioning,
        clock: StageClock,
        on_step: StepCallback | None,
        sink: FrameSink | None,
    ) -> GenerationResult:
        enc = self.encoder.encode(plan, cond, clock)
        dit = self.components.transformer_ref if cond.references else self.components.transformer
        target = Target.of(plan)
        edits = self.encoder.edit_targets(plan, cond, clock) if plan.edit else (None, None)
        forwards = len(self.sampler.schedules(plan)[0])
        cached = self.cache is not None and dit is not None
        with self.cache.for_request(dit, plan.quality, forwards) if cached else nullcontext() as cache:
            video_latents, audio_latents = self.sampler.sample(plan, enc, dit, target, plan.seed, clock, on_step, edits)
        clock.record_denoise_per_step()
        return self.decoder.decode(video_latents, audio_latents, clock, cache, sink)

    @torch.no_grad()
    def encode(self, plan: GenerationPlan, cond: Conditioning, clock: StageClock | None = None) -> Encoded:
        """Presentation -> text states, condition latents and the packed layout (the first stage alone)."""
        return self.encoder.encode(plan, cond, clock or StageClock(self.device, self.hooks))
