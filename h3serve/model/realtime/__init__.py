"""Causal chunked generation with TaoMate-H3's streaming LoRA (pure torch): see `session.py`."""
