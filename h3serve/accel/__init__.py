"""Speed features around the DiT that leave its math alone: torch.compile (compile.py)."""
