"""Multi-rank execution: process groups, DiT tensor parallel, Ulysses / Ring sequence parallel (and their
hybrid), text-encoder tensor parallel and VAE tile parallel.

`degrees` is pure (validation and rank coordinates, no torch.distributed); `setup.RankParallel` is what a rank
process applies to its components. Everything else is one strategy per module.
"""
