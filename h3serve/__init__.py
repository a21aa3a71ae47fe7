"""h3serve: a serving engine for MiniMax-H3, joint video + stereo audio diffusion."""

__version__ = "0.1.0"
