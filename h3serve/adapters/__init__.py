"""Adapters of the DiT weights, torch-free: request fields, allow-listed paths, file contracts and metadata.

The rank side (h3serve.rank.lora, h3serve.loading.fasth3_fusion) applies what this package has checked: a per-request
LoRA as an unmerged wrapper on the declared target layers, a FastH3 adapter fused into the weights at load.
"""
