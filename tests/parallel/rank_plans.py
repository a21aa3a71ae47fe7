"""The request the multi-rank tests run, torch-free (a node process of the two-namespace test plans it too)."""

from __future__ import annotations

from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import GenerationPlan, ModelDefaults, validate

# 17 byte-level tokens: with 4 s at 128x64 the packed sequence is 17 + 2·178 audio + 256 video = 629 rows,
# which no degree used here (2, 3, 4) divides, so every layout runs with padded chunks.
PROMPT = "waves on a beach!"
STEPS, SEED, DURATION_S = 2, 1, 4


def plan_for(defaults: ModelDefaults, steps: int = STEPS) -> GenerationPlan:
    return validate(GenerationRequest(prompt=PROMPT, steps=steps, seed=SEED, duration_s=DURATION_S), defaults)
