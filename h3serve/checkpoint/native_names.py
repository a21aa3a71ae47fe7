"""Native (MiniMaxAI / ComfyUI) transformer key names -> diffusers names, torch-free: the planner reads them to
size a native checkpoint, the loader (h3serve.loading.dit_keys) to convert its tensors."""

from __future__ import annotations

_RENAMES = (
    ("token_refiner.blocks.", "token_refiner.refiner_blocks."),
    ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("video_patch_proj.", "proj_in."),
    ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."),
    ("final_layer.norm.", "norm_out.norm."),
    ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."),
    (".attn.q_norm.", ".attn.norm_q."),
    (".attn.k_norm.", ".attn.norm_k."),
    (".attn.out_proj.", ".attn.to_out.0."),
    (".mlp.fc1.", ".ff.net.0.proj."),
    (".mlp.fc2.", ".ff.net.2."),
)
_NATIVE_MARKERS = ("video_patch_proj.", "condition_proj.", "final_layer.", "blocks.0.attn.qkv_proj.")


def is_native_key_set(keys: list[str]) -> bool:
    """True when the keys use the native naming (any key with a native-only prefix)."""
    return any(k.startswith(m) or f".{m}" in k for k in keys for m in _NATIVE_MARKERS)


def native_to_diffusers_name(key: str) -> str:
    """Rename one native key (the fused `qkv_proj` keeps its name; `split_native_tensor` splits it)."""
    if key.startswith("blocks."):
        key = "transformer_blocks." + key[len("blocks.") :]
    for old, new in _RENAMES:
        key = key.replace(old, new)
    return key


def diffusers_to_native_name(key: str) -> str:
    """The inverse of `native_to_diffusers_name` (the fused QKV and fc1 tensors: h3serve.loading.dit_keys)."""
    for old, new in reversed(_RENAMES):
        key = key.replace(new, old)
    if key.startswith("transformer_blocks."):
        key = "blocks." + key[len("transformer_blocks.") :]
    return key


def native_module_names(module: str) -> tuple[str, ...]:
    """A native module name -> the diffusers modules it holds (the fused `qkv_proj` holds to_q, to_k, to_v)."""
    name = native_to_diffusers_name(module + ".weight")[: -len(".weight")]
    if name.endswith(".attn.qkv_proj"):
        stem = name[: -len("qkv_proj")]
        return tuple(stem + part for part in ("to_q", "to_k", "to_v"))
    return (name,)
