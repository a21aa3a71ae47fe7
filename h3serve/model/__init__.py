"""The H3 model in pure torch (no I/O): transformer, token layout and RoPE, scheduler, conditioning, pipeline."""
