"""Timeline guides with a per-request LoRA (which vLLM-Omni refuses): served, and right. The unmerged adapter on a
guided packed sequence (an image guide, a clip guide's two latent frames, a sound guide, a first keyframe) equals the
DiT whose weights the test merges in plain torch, on every row the sampler reads; the guide rows change the targets'
velocities, so the comparison is not vacuous. (A distilled adapter with a pinned schedule is refused:
tests/rules/test_guides.py.)"""

from __future__ import annotations

import copy
import dataclasses

import torch
from safetensors.torch import load_file
from small_dit import SMALL_DIT, random_small_dit

from h3serve.model.layout import TEXT_TAG, GuideBlock, build_keyframe_layout, patchify
from h3serve.model.transformer import H3TransformerConfig
from h3serve.rank.lora import LoraRuntime
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.tools.tiny.make_adapter import write_peft_adapter

FRAMES, LH, LW, AUDIO, TEXT = 7, 2, 4, 12, 7
GUIDES = (GuideBlock(9, latent_frames=1), GuideBlock(14, latent_frames=2), GuideBlock(3, audio_latents=5))


def _inputs(guides: tuple[GuideBlock, ...]):
    g = torch.Generator().manual_seed(3)
    layout = build_keyframe_layout(torch.full((TEXT,), TEXT_TAG), FRAMES, LH, LW, AUDIO, ("first",), guides)
    condition_frames = sum(b.latent_frames for b in guides) + 1
    video = patchify(torch.randn(1, 24, FRAMES + condition_frames, LH, LW, generator=g))[None]
    audio = torch.randn(1, 2 * (AUDIO + sum(b.audio_latents for b in guides)), 32, generator=g)
    text = torch.randn(1, TEXT, SMALL_DIT["text_dim"], generator=g)
    timestep, row_index = layout.row_timesteps(0.3, 0.6)
    return video, audio, text, timestep, row_index, layout


def _targets(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The velocities of the rows the sampler steps: the target video and audio rows."""
    video, audio, text, timestep, row_index, layout = inputs
    with torch.inference_mode():
        v, a = model(video, audio, model.embed_text(text), timestep, row_index, layout.packed)
    return v[:, layout.num_video_condition_rows :], a[:, layout.num_audio_reference_rows :]


def test_a_lora_on_a_guided_request_equals_the_merged_dit(tmp_path):
    cfg = dataclasses.asdict(H3TransformerConfig(**SMALL_DIT))
    path = write_peft_adapter(tmp_path / "a", cfg, rank=4, alpha=8.0, seed=1)
    base = random_small_dit()
    merged = copy.deepcopy(base)
    factors = load_file(str(path))
    with torch.no_grad():  # the test's own merge: W + s·alpha/r·B@A
        for key, a in factors.items():
            if ".lora_A." in key:
                b = factors[key.replace(".lora_A.", ".lora_B.")]
                merged.get_submodule(key.split(".lora_A.")[0]).weight += 0.8 * 8.0 / 4 * (b @ a)
    merged.fuse_projections()
    served = copy.deepcopy(base)
    served.fuse_projections()
    runtime = LoraRuntime({"transformer": served}, slot_rank=4)
    runtime.activate("transformer", AdapterChoice("a", str(path), 0.8, 1, 4, 8.0))
    guided = _inputs(GUIDES)
    for ours, theirs in zip(_targets(served, guided), _targets(merged, guided), strict=True):
        assert (ours - theirs).abs().max() <= 1e-4
    # The same keyframe and target rows without the guides' rows: the guides change the targets' velocities.
    video, audio, text = guided[:3]
    plain = _inputs(())
    guide_video, guide_audio = 3 * (LH // 2) * (LW // 2), 2 * 5
    unguided = (video[:, guide_video:], audio[:, guide_audio:], text, *plain[3:])
    with_guides, without = _targets(served, guided), _targets(served, unguided)
    assert with_guides[0].shape == without[0].shape
    assert (with_guides[0] - without[0]).abs().max() > 1e-3 and (with_guides[1] - without[1]).abs().max() > 1e-3
