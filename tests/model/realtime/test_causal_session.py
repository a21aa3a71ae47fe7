"""A real-time session on the tiny checkpoint: deterministic per seed, its frames and samples as the plan publishes
them, the clean K/V cache bounded, and a prompt change reaching the student from the next chunk on."""

from __future__ import annotations

import torch

from h3serve.model.realtime.causal_session import CausalSession
from h3serve.model.realtime.prompt import encode_prompt
from h3serve.rules import realtime_geometry as rt


def _session(parts, seed: int, chunks: int) -> CausalSession:
    return CausalSession(parts.components, parts.device, 64, 64, seed, chunks, parts.lora)


def _run(parts, seed: int, chunks: int, prompts) -> list:
    session = _session(parts, seed, chunks)
    try:
        return [session.run_chunk(prompts[min(i, len(prompts) - 1)]) for i in range(chunks)]
    finally:
        session.close()


def test_a_session_is_deterministic_per_seed_and_publishes_its_plan(realtime_parts):
    prompt = encode_prompt(realtime_parts.components, "a red fox runs through snow")
    first = _run(realtime_parts, 7, 8, [prompt])
    again = _run(realtime_parts, 7, 8, [prompt])
    other = _run(realtime_parts, 8, 2, [prompt])
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.frames, b.frames) and torch.equal(a.audio, b.audio)
    assert not torch.equal(first[1].frames, other[1].frames)
    frames = torch.cat([m.frames for m in first])
    audio = torch.cat([m.audio for m in first], dim=1)
    assert frames.shape == (rt.session_frames(8), 64, 64, 3) and audio.shape == (2, rt.samples_at(243))
    assert [m.first_frame for m in first] == [rt.published_frames(i, 8)[0] for i in range(8)]
    assert frames.float().std() > 1 and audio.abs().max() > 0


def test_the_cache_stays_bounded_at_the_planned_bytes(realtime_parts):
    prompt = encode_prompt(realtime_parts.components, "waves")
    session = _session(realtime_parts, 1, 12)
    dit = realtime_parts.dit.config
    assert session.cache.nbytes == rt.kv_cache_bytes(dit.num_layers, dit.num_attention_heads,
                                                     dit.attention_head_dim, 4, frame_rows=4)
    history: tuple[rt.CachedChunk, ...] = ()
    try:
        for index in range(12):
            session.run_chunk(prompt)
            history = rt.apply_keep((*history, rt.chunk_rows(rt.chunk(index), 4)), rt.kept_after_commit(
                len(history) + 1))
            assert session.cache.chunks == history and session.cache.rows <= session.cache.capacity
    finally:
        session.close()
    assert len(history) == 3 and history[0].audio_rows == 0


def test_a_new_prompt_reaches_the_student_from_the_next_chunk_and_the_teacher_from_the_next_request(
    realtime_parts,
):
    components, dit, lora = realtime_parts.components, realtime_parts.dit, realtime_parts.lora
    a, b = encode_prompt(components, "a quiet library"), encode_prompt(components, "a loud rock concert on stage")
    with torch.no_grad():
        lora.student()
        student = {"a": dit.embed_text(a.states), "b": dit.embed_text(b.states)}
        lora.base()
        teacher = {"a": dit.embed_text(a.states), "b": dit.embed_text(b.states)}
    seen: list[str] = []

    def which(_module, args):
        text = args[2]
        for name, table in (("student", student), ("teacher", teacher)):
            for key, value in table.items():
                if text.shape == value.shape and torch.equal(text, value):
                    seen.append(f"{name}-{key}")
                    return
        seen.append("unknown")

    handle = dit.register_forward_pre_hook(which)
    try:
        _run(realtime_parts, 3, 8, [a, a, b])  # the prompt changes at chunk 2's boundary
    finally:
        handle.remove()
    per_chunk = 3 + 1  # three student steps and the σ = 0 pass
    request0 = ["teacher-a"] * 9 + ["student-a"] * per_chunk * 2 + ["student-b"] * per_chunk * 2
    request1 = ["teacher-b"] * 9 + ["student-b"] * per_chunk * 4
    assert seen == request0 + request1
