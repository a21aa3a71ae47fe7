"""The demo world's defaults shared by `make demo`-style runs, the evaluation and the scripts (no torch here)."""

from __future__ import annotations

DEMO_PROMPT = "a red ball bouncing, with a high beep"
DEMO_DURATION_S = 4.0  # the length the demo DiTs are trained on (107 frames)
DEMO_STEPS = 20
