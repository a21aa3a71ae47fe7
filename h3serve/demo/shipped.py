"""The demo world's defaults shared by `make demo`-style runs, the evaluation and the scripts (no torch here), and
where the trained demo checkpoint ships (package data beside this module, written by `h3serve train-demo`)."""

from __future__ import annotations

from pathlib import Path

DEMO_PROMPT = "a red square moving right, with a high beep"  # one the shipped weights get right (docs/demo_world.md)
DEMO_DURATION_S = 4.0  # the length the demo DiTs are trained on (107 frames)
DEMO_STEPS = 20
DEMO_CHECKPOINT_DIR = Path(__file__).with_name("checkpoint")
DEMO_TRAINING_COMMAND = "h3serve train-demo --recipe run15 --out h3serve/demo/checkpoint"  # what ships


def shipped_demo_checkpoint() -> Path | None:
    """The trained demo checkpoint shipped with the package, or None where it is absent (a trimmed install)."""
    return DEMO_CHECKPOINT_DIR if (DEMO_CHECKPOINT_DIR / "modular_model_index.json").is_file() else None
