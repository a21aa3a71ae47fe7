"""AdaLN sidecars on one rank: written on a miss, read on a hit with the same latents, and a sidecar with
another digest refused (never used) and rewritten."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3serve.loading.adaln_sidecar import load_sidecars
from h3serve.model.adaln_memo import AdaLNMemo
from h3serve.model.pipeline import H3Pipeline
from h3serve.model.pipeline_types import Conditioning, LatentTarget, StageClock
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate

STEPS = 3  # the "default" schedule these sidecars hold (the engine uses the default 50)


def _latents(pipeline: H3Pipeline, plan) -> tuple[torch.Tensor, torch.Tensor]:
    clock = StageClock(pipeline.device)
    enc = pipeline.encode(plan, Conditioning(), clock)
    target = LatentTarget.of(plan)
    return pipeline.sampler.sample(plan, enc, pipeline.components.transformer, target, plan.seed, clock, None)


def test_a_sidecar_is_written_then_read_with_the_same_bits_and_another_digest_is_refused(tiny_pipeline, tmp_path):
    plain, defaults = tiny_pipeline
    plan = validate(GenerationRequest(prompt="A fox", duration_s=4, steps=STEPS, seed=5), defaults)
    reference = _latents(plain, plan)
    lines: list[str] = []

    def engine(memo: AdaLNMemo) -> tuple[H3Pipeline, dict[str, str]]:
        pipeline = H3Pipeline(plain.components, adaln=memo)
        return pipeline, load_sidecars(pipeline, memo, tmp_path, defaults, 0, 1, lines.append, steps=plan.steps)

    miss = AdaLNMemo(2**30)
    pipeline, outcomes = engine(miss)
    assert outcomes == {"transformer": "missing", "transformer_ref": "missing"} and lines == []
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["transformer.rank0-of-1.safetensors", "transformer_ref.rank0-of-1.safetensors"]
    computed = miss.misses
    assert computed > 0 and len(miss) == computed
    for got, want in zip(_latents(pipeline, plan), reference, strict=True):
        assert torch.equal(got, want)
    assert miss.misses == computed  # the request found every step in the memo

    hit = AdaLNMemo(2**30)
    pipeline, outcomes = engine(hit)
    assert outcomes == {"transformer": "hit", "transformer_ref": "hit"} and hit.misses == 0 and len(hit) == computed
    for got, want in zip(_latents(pipeline, plan), reference, strict=True):
        assert torch.equal(got, want)
    assert hit.misses == 0

    # The same tensors under another digest (other weights, schedule or device): refused, recomputed, rewritten.
    path = tmp_path / "transformer.rank0-of-1.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    digest = meta["digest"]
    save_file({k: torch.zeros_like(t) for k, t in tensors.items()}, str(path), metadata=meta | {"digest": "0" * 64})
    refused = AdaLNMemo(2**30)
    pipeline, outcomes = engine(refused)
    assert outcomes["transformer"].startswith("refused: digest 0000000000000000 is not this engine's")
    assert outcomes["transformer_ref"] == "hit"
    assert any("transformer.rank0-of-1.safetensors: refused" in line for line in lines)
    assert refused.misses > 0  # computed, not read: the zeroed tables were never used
    assert all(e.output.abs().max() > 0 for _, e in refused.items())
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["digest"] == digest
