"""Qwen3-VL conditioning: prompt (and presentation) tokens -> hidden_states[50] (docs/model.md §7).

The prompt is tokenized verbatim: no chat template, no special tokens, no padding, no truncation. With a prompt
cache (h3serve.model.prompt_cache) a presentation encoded before is not encoded again.
"""

from __future__ import annotations

import torch
from torch import nn

from h3serve.model.prompt_cache import PromptCache, PromptKey, vision_digest

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"


class TextConditioner:
    """Wraps a `Qwen3VLForConditionalGeneration` (or its `.model`) and its tokenizer."""

    def __init__(self, encoder: nn.Module, tokenizer, layer: int = 50):
        self.model = getattr(encoder, "model", encoder)  # the Qwen3VLModel: the LM head is never used
        self.tokenizer = tokenizer
        self.layer = layer
        num_layers = len(self.model.language_model.layers)
        if num_layers <= layer:
            raise ValueError(
                f"MiniMax-H3 conditions on hidden_states[{layer}] of Qwen3-VL, which needs more than {layer} "
                f"decoder layers; the text encoder has {num_layers}"
            )
        self._image_pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self._video_pad = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        self.cache: PromptCache | None = None  # set by the engine (--prompt-cache)

    @property
    def identity(self) -> str:
        """Which encoder this is, for the prompt cache's key: its checkpoint, class and the layer read."""
        source = getattr(self.model.config, "_name_or_path", "") or ""
        return f"{source}:{type(self.model).__name__}:{self.layer}"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def mm_token_types(self, ids: list[int]) -> list[int]:
        """Qwen's own modality ids driving M-RoPE: 0 text, 1 image pad, 2 video pad."""
        return [1 if i == self._image_pad else 2 if i == self._video_pad else 0 for i in ids]

    def prompt_key(self, ids: list[int], vision: dict[str, torch.Tensor] | None = None) -> PromptKey | None:
        """The prompt cache's key of a presentation; None without a cache."""
        if self.cache is None:
            return None
        return PromptKey(self.identity, str(self.dtype), tuple(ids), vision_digest(vision))

    def cached(self, key: PromptKey | None) -> torch.Tensor | None:
        """The states the prompt cache holds under `key`, on the encoder's device; None on a miss or without one."""
        return None if key is None or self.cache is None else self.cache.get(key, self.device)

    @torch.no_grad()
    def encode(
        self, ids: list[int], vision: dict[str, torch.Tensor] | None = None, key: PromptKey | None = None
    ) -> torch.Tensor:
        """Token ids (+ optional pixel tensors) -> [1, L, hidden] at the encoder's dtype, through the encoder; kept
        in the prompt cache under `key` when given."""
        states = self.run(ids, vision)
        if key is not None and self.cache is not None:
            self.cache.put(key, states)
        return states

    @torch.no_grad()
    def run(self, ids: list[int], vision: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The encoder's forward: token ids (+ optional pixel tensors) -> hidden_states[layer] [1, L, hidden]."""
        device = self.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        extra = {
            k: v.to(device, self.dtype) if k.startswith("pixel_") else v.to(device) for k, v in (vision or {}).items()
        }
        out = self.model(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=torch.tensor([self.mm_token_types(ids)], dtype=torch.long, device=device),
            use_cache=False,
            output_hidden_states=True,
            **extra,
        )
        return out.hidden_states[self.layer]
