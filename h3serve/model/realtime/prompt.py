"""A real-time prompt's text states: the T2VA presentation (the prompt alone) through the text encoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3serve.model.conditioning import Presentation
from h3serve.model.encode_inputs import encode_text
from h3serve.model.pipeline_types import H3Components


@dataclass(frozen=True)
class PromptStates:
    """One prompt as the DiT reads it: the text encoder's states and each token's AdaLN tag."""

    prompt: str
    states: torch.Tensor  # [1, L, text_dim]
    tags: torch.Tensor  # [L] long (1: text)

    @property
    def length(self) -> int:
        return int(self.tags.shape[0])


@torch.no_grad()
def encode_prompt(components: H3Components, prompt: str) -> PromptStates:
    """The prompt's states, as a T2VA request without keyframes encodes it (every rank calls this together: the
    text encoder may be tensor-parallel)."""
    text = Presentation(components.text.tokenizer)
    text.text(prompt)
    states = encode_text(components, text.ids, {})  # a prompt seen before comes from the prompt cache
    return PromptStates(prompt, states, torch.tensor(text.tags, dtype=torch.long))
