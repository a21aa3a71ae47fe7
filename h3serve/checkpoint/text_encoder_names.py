"""The text encoder's checkpoint key names -> `Qwen3VLModel` names, torch-free: the planner counts a stored FP8
text encoder with them, the loaders (h3serve.loading) read it with them."""

from __future__ import annotations

from collections.abc import Callable

from h3serve.checkpoint.resolver import CheckpointError


def checkpoint_key_to_name(key: str, num_layers: int) -> str | None:
    """A Qwen3-VL checkpoint key -> its `Qwen3VLModel` parameter name; None for what is never loaded (the LM
    head, decoder layers past `num_layers`). Both the current (`model.language_model.*`, `model.visual.*`) and
    the older (`model.layers.*`, `visual.*`) layouts are read."""
    if key.startswith("lm_head."):
        return None
    if key.startswith(("model.language_model.", "model.visual.")):
        name = key[len("model.") :]
    elif key.startswith("model."):
        name = "language_model." + key[len("model.") :]
    elif key.startswith("visual."):
        name = key
    else:
        raise CheckpointError(f"unexpected text-encoder weight {key!r}")
    if name.startswith("language_model.layers."):
        if int(name.split(".")[2]) >= num_layers:
            return None
    return name


def checkpoint_module_names(num_layers: int) -> Callable[[str], tuple[str, ...]]:
    """A checkpoint module name -> the `Qwen3VLModel` module it is (none for what is never loaded)."""

    def rename(module: str) -> tuple[str, ...]:
        name = checkpoint_key_to_name(f"{module}.weight", num_layers)
        return () if name is None else (name[: -len(".weight")],)

    return rename
