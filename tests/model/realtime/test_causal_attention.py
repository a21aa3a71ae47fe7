"""The causal attention equals plain attention under TaoMate-H3's mask, and stages the clean media keys."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from small_dit import random_small_dit

from h3serve.model.layout import TEXT_TAG, build_keyframe_layout, patchify
from h3serve.model.realtime.causal_attention import CausalAttention
from h3serve.model.realtime.kv_cache import CleanKVCache
from h3serve.rules.realtime_geometry import CachedChunk


def _masked_reference(q, k, v, history_k, history_v, text):
    """Attention over [history | document] with a boolean mask: text rows see text rows; media rows see all."""
    keys, values = torch.cat([history_k, k], 1), torch.cat([history_v, v], 1)
    rows, history = q.shape[1], history_k.shape[1]
    allowed = torch.ones(rows, history + rows, dtype=torch.bool)
    allowed[:text, :history] = False
    allowed[:text, history + text :] = False
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=allowed)
    return out.transpose(1, 2)


def test_the_core_is_the_masked_attention_and_padding_rows_are_zero():
    dit = random_small_dit()
    heads, dim = dit.config.num_attention_heads, dit.config.attention_head_dim
    cache = CleanKVCache(len(dit.transformer_blocks), heads, dim, 64, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    history = torch.randn(1, 9, heads, dim, generator=g), torch.randn(1, 9, heads, dim, generator=g)
    for layer in range(len(dit.transformer_blocks)):
        cache.stage(layer, *history)
    cache.commit(CachedChunk(4, 5))
    originals = [b.attn.attention_fn for b in dit.transformer_blocks]
    causal = CausalAttention(dit)
    causal.install(cache)
    text, doc, padded = 5, 17, 20
    q, k, v = (torch.randn(1, padded, heads, dim, generator=g) for _ in range(3))
    core = dit.transformer_blocks[1].attn.attention_fn
    outside = core(q, k, v)  # no chunk in flight: the block's own attention
    assert torch.equal(outside, originals[1](q, k, v))
    with causal.chunk(text, doc, commit=True):
        out = core(q, k, v)
    want = _masked_reference(q[:, :doc], k[:, :doc], v[:, :doc], *history, text)
    assert torch.allclose(out[:, :doc], want, atol=1e-5) and not out[:, doc:].any()
    assert cache.staged[1] == doc - text and cache.staged[0] is None
    staged_k = cache.keys[1, 9 : 9 + doc - text]
    assert torch.equal(staged_k, k[0, text:doc])
    installed = [b.attn.attention_fn for b in dit.transformer_blocks]
    causal.uninstall()
    assert [b.attn.attention_fn for b in dit.transformer_blocks] == originals
    causal.install(cache)  # the next session reinstalls the same callables (a compiled block's guards hold)
    assert [b.attn.attention_fn for b in dit.transformer_blocks] == installed


def test_the_dit_forward_is_unchanged_outside_a_chunk():
    dit = random_small_dit()
    plain = copy.deepcopy(dit)
    cache = CleanKVCache(len(dit.transformer_blocks), 2, 32, 8, torch.float32, torch.device("cpu"))
    CausalAttention(dit).install(cache)
    layout = build_keyframe_layout(torch.full((6,), TEXT_TAG), 3, 2, 4, 5)
    g = torch.Generator().manual_seed(1)
    video = patchify(torch.randn(1, 24, 3, 2, 4, generator=g))[None]
    audio = torch.randn(1, 10, 32, generator=g)
    text = torch.randn(1, 6, 32, generator=g)
    timestep, rows = layout.row_timesteps(0.4, 0.6)
    with torch.no_grad():
        ours = dit(video, audio, dit.embed_text(text), timestep, rows, layout.packed)
        theirs = plain(video, audio, plain.embed_text(text), timestep, rows, layout.packed)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
