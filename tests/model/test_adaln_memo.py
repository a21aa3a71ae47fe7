"""Exact AdaLN memoisation: precomputed modulations give the forward's bits; the store is bounded and keyed by the
step's whole timestep tuple; a request with memoisation on writes the same raw arrays and MP4 as with it off."""

from __future__ import annotations

import pytest
import torch
from small_dit import SMALL_DIT

from h3serve.media.mp4 import write_mp4
from h3serve.model.adaln_memo import AdaLNMemo, ForwardTimes, compute_entries, memo_key, no_scope
from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify
from h3serve.model.pipeline import H3Pipeline
from h3serve.model.pipeline_types import Conditioning, LatentTarget, StageClock
from h3serve.model.transformer import H3Transformer, H3TransformerConfig
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate

WIDE_ADALN = SMALL_DIT | {"hidden_size": 128, "num_attention_heads": 4, "time_embed_dim": 512}


def _model(dims: dict, dtype: torch.dtype) -> H3Transformer:
    torch.manual_seed(0)
    model = H3Transformer(H3TransformerConfig(**dims)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.to(dtype)
    for name in H3Transformer.keep_in_fp32_modules:  # the load dtype policy: temb stays fp32
        getattr(model, name).float()
    return model


def _inputs(model: H3Transformer, frames: int = 3):
    g = torch.Generator().manual_seed(1)
    text_len, lh, lw, audio = 7, 2, 4, 3 * frames
    layout = build_keyframe_layout(torch.full((text_len,), TEXT_TAG), frames, lh, lw, audio, anchors=("first",))
    video = patchify(torch.randn(1, 24, frames + 1, lh, lw, generator=g))[None]
    audio_rows = torch.randn(1, 2 * audio, 32, generator=g)
    text = model.embed_text(torch.randn(1, text_len, model.config.text_dim, generator=g))
    return layout, video, audio_rows, text


# (t_video, t_audio) -> T distinct timesteps (with the 0.999 condition rows): 1, 2, 3, 3
STEPS = [(0.999, 0.999), (0.25, 0.25), (0.3, 0.6), (0.0, 1.0)]


@pytest.mark.parametrize("dims", [SMALL_DIT, WIDE_ADALN], ids=["small", "wide_adaln"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_precomputed_modulations_give_the_forwards_bits(dims, dtype):
    model = _model(dims, dtype)
    layout, video, audio, text = _inputs(model)
    steps = [ForwardTimes(*layout.row_timesteps(tv, ta)) for tv, ta in STEPS]
    assert sorted({s.timestep.numel() for s in steps}) == [1, 2, 3]
    memo = AdaLNMemo(2**30)
    with torch.inference_mode():
        mods = memo.prepare("transformer", model, steps, layout.packed.token_tags, torch.device("cpu"))
        for step, mod in zip(steps, mods, strict=True):
            plain = model(video, audio, text, step.timestep, step.row_index, layout.packed)
            memoised = model(video, audio, text, step.timestep, step.row_index, layout.packed, mod)
            for a, b in zip(plain, memoised, strict=True):
                assert torch.equal(a, b)
            assert plain[0].abs().max() > 0
    # Only the rows the step's tokens read are kept: FL2VA reads 4 of the 9 rows of a 3-timestep table.
    kept = {s.timestep.numel(): mods[i].tables[model.transformer_blocks[0].adaln_proj].shape[1] for i, s in
            enumerate(steps)}
    assert kept[3] == 4


def test_the_key_is_the_whole_timestep_tuple_and_the_store_is_bounded():
    model = _model(SMALL_DIT, torch.float32)
    layout, *_ = _inputs(model)
    tags = layout.packed.token_tags
    a = ForwardTimes(*layout.row_timesteps(0.3, 0.6))
    b = ForwardTimes(*layout.row_timesteps(0.3, 0.7))  # shares 0.3 and 0.999 with `a`: still its own entry
    cpu = torch.device("cpu")
    with torch.inference_mode():
        one = compute_entries(model, [a], [a.slots(tags)], cpu, no_scope)[0]
    memo = AdaLNMemo(limit_bytes=2 * one.nbytes)
    with torch.inference_mode():
        memo.prepare("transformer", model, [a, b, a], tags, cpu)
    assert (memo.misses, memo.hits, len(memo)) == (2, 0, 2)
    assert memo_key("transformer", model, a, a.slots(tags)) != memo_key("transformer", model, b, b.slots(tags))
    assert memo_key("transformer", model, a, a.slots(tags)) != memo_key("transformer_ref", model, a, a.slots(tags))
    c = ForwardTimes(*layout.row_timesteps(0.4, 0.6))
    with torch.inference_mode():
        memo.prepare("transformer", model, [c, b], tags, cpu)  # b is a hit; c evicts the least recent (a)
    assert (memo.misses, memo.hits, len(memo)) == (3, 1, 2) and memo.nbytes <= memo.limit_bytes
    keys = {k.timestep for k, _ in memo.items()}
    assert memo_key("transformer", model, a, a.slots(tags)).timestep not in keys


def test_the_store_holds_each_entry_in_one_pinned_arena_of_exactly_its_bytes(monkeypatch):
    """A GPU engine's store (`host_copy=pinned_copy`): every entry, sidecar entries included, in one arena pinned
    with one registration of exactly its bytes, before the copies into it (no caching host allocator rounding,
    issue 29 item 3); evicted entries unpin. cudaHostRegister is stood in."""
    import gc

    from h3serve.offload import host_arena

    registered: list[int] = []
    monkeypatch.setattr(host_arena, "_register", lambda ptr, size: registered.append(size))
    monkeypatch.setattr(host_arena, "_unregister", lambda ptr: None)
    model = _model(SMALL_DIT, torch.float32)
    layout, *_ = _inputs(model)
    tags = layout.packed.token_tags
    steps = [ForwardTimes(*layout.row_timesteps(tv, ta)) for tv, ta in STEPS]
    cpu = torch.device("cpu")
    with torch.inference_mode():
        entries = compute_entries(model, steps, [s.slots(tags) for s in steps], cpu, no_scope)
    before = host_arena.pinned_bytes()
    memo = AdaLNMemo(limit_bytes=sum(e.nbytes for e in entries[1:]), host_copy=host_arena.pinned_copy)
    for step, entry in zip(steps, entries, strict=True):
        memo.put(memo_key("transformer", model, step, step.slots(tags)), entry)
    assert registered == [e.nbytes for e in entries]  # one arena per entry, as it was put
    kept = [e for _, e in memo.items()]
    assert len(kept) == 3 and host_arena.pinned_bytes() - before == memo.nbytes == sum(registered[1:])
    for stored, entry in zip(kept, entries[1:], strict=True):
        storages = {t.untyped_storage().data_ptr() for t in stored.tensors}
        assert storages == {stored.owner.buffer.untyped_storage().data_ptr()}  # every tensor a view of its arena
        assert all(torch.equal(a, b) for a, b in zip(stored.tensors, entry.tensors, strict=True))
    del kept, stored
    gc.collect()
    assert host_arena.pinned_bytes() - before == memo.nbytes  # the evicted entry's arena unpinned
    del memo
    gc.collect()
    assert host_arena.pinned_bytes() == before


def test_memo_on_and_off_write_the_same_raw_arrays_and_mp4(tiny_pipeline, tmp_path):
    plain, defaults = tiny_pipeline
    memo = AdaLNMemo(2**30)
    memoised = H3Pipeline(plain.components, adaln=memo)
    plan = validate(GenerationRequest(prompt="A fox", duration_s=4, steps=3, seed=5), defaults)
    off = plain.generate(plan)
    forwards = len(memoised.sampler.schedules(plan)[0])
    on = memoised.generate(plan)  # computes each forward's modulations once
    assert (memo.misses, memo.hits) == (forwards, 0)
    assert torch.equal(on.video, off.video) and torch.equal(on.audio, off.audio)
    assert off.video.std() > 0.01
    write_mp4(tmp_path / "off.mp4", off.video.numpy(), off.audio.numpy())
    write_mp4(tmp_path / "on.mp4", on.video.numpy(), on.audio.numpy())
    assert (tmp_path / "off.mp4").read_bytes() == (tmp_path / "on.mp4").read_bytes()
    # A later request takes every step from the store: the same latents (the decode is the same function).
    clock = StageClock(memoised.device)
    enc = memoised.encode(plan, Conditioning(), clock)
    dit = plain.components.transformer
    video, audio = memoised.sampler.sample(plan, enc, dit, LatentTarget.of(plan), plan.seed, clock, None)
    assert (memo.misses, memo.hits) == (forwards, forwards)
    assert torch.equal(video, off.video_latents) and torch.equal(audio, off.audio_latents)
